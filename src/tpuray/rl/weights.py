"""Hugging Face parameter names <-> the embedded engine's fused, tensor-parallel tensors, in one place.

The embedded engine (`tpuray.serve.llm.engine.embedded.model.ShardedLlama`) holds each layer's q/k/v as one fused
`qkv` tensor and gate/up as one `gate_up`, split over the tensor-parallel ranks Megatron-style:
column-parallel tensors (q, k, v, gate, up and their biases) take this rank's chunk of dim 0, row-parallel
ones (o_proj, down_proj) this rank's chunk of dim 1; embeddings, norms and lm_head are replicated. This
module mirrors those rules so that an update from a trainer lands in every rank's tensors exactly as
loading the same checkpoint from disk would:

- `expected_shapes(config)`: every HF name a full state dict of the model has, with its shape;
- `check_state(shapes, config)`: refuses a state dict with a missing, unknown or misshapen tensor, naming
  the first one and the expected shape (before anything is written);
- `shard_state(state, config, rank, world_size)`: this rank's fused tensors, keyed by `engine_tensors`'s
  names;
- `engine_tensors(model)`: the engine's own tensors under those names (what an update overwrites in place);
- `put_shards(state, config, tensor_parallel_size)`: on the sender (a trainer rank), cut every rank's
  shards and put each in Ray's object store: a `ShardedUpdate`, so that each engine rank receives only its
  part; `check_shards` is the receiving rank's check;
- `embedded_part(name, full_shape, rank, world_size)`: a rank's part of one HF tensor, as (dim, lo, hi);
  `join_pieces` / `assemble` rebuild a rank's parts from the pieces trainer ranks sent: `join_pieces`
  takes the layout as a `part` function (`embedded_part` by default, `tpuray.rl.vllm_layout.vllm_part`
  for vLLM); `assemble` is the embedded engine's (`embedded_part`, fused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tpuray.rl import rows
from tpuray.rl.rows import Rows

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj")  # fused, in this order, into "qkv"


class WeightMismatchError(ValueError):
    """A weight update whose names or shapes differ from the engine's model; nothing was overwritten."""


def _has_attention_bias(config: Mapping[str, Any]) -> bool:
    return bool(config.get("attention_bias")) or config.get("model_type") == "qwen2"


def _tied(config: Mapping[str, Any]) -> bool:
    return bool(config.get("tie_word_embeddings", False))


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a full HF state dict of this Llama-family model (config.json), with its shape. A
    model with tied embeddings may also send `lm_head.weight` (HF's state_dict() has it): see
    `optional_names`."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not _tied(config):
        shapes["lm_head.weight"] = (vocab, hidden)
    out = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for name, n in out.items():
            shapes[p + f"self_attn.{name}.weight"] = (n, hidden)
            if _has_attention_bias(config):
                shapes[p + f"self_attn.{name}.bias"] = (n,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def optional_names(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names a state dict may carry beyond `expected_shapes`: a tied model's lm_head."""
    if _tied(config):
        return {"lm_head.weight": (config["vocab_size"], config["hidden_size"])}
    return {}


def check_state(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> None:
    """Raise WeightMismatchError naming the first missing, unknown or misshapen tensor of `shapes` (name
    -> shape of an update) against the model of `config`."""
    expected = expected_shapes(config)
    allowed = {**expected, **optional_names(config)}
    for name, shape in shapes.items():
        if name not in allowed:
            known = ", ".join(list(allowed)[:4])
            raise WeightMismatchError(
                f"weight update: unknown tensor {name!r} (shape {tuple(shape)}); the engine's model has "
                f"{len(allowed)} tensors named like {known}, ..."
            )
        if tuple(shape) != allowed[name]:
            raise WeightMismatchError(
                f"weight update: tensor {name!r} has shape {tuple(shape)}; expected {allowed[name]}"
            )
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise WeightMismatchError(
            f"weight update: tensor {missing[0]!r} (shape {expected[missing[0]]}) is missing "
            f"({len(missing)} of {len(expected)} missing); send the full state dict"
        )


def shapes_of(state: Mapping[str, Any], dtensors: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> shape of a state dict; a value that is not a full floating-point tensor is a
    WeightMismatchError (`dtensors`: a DTensor counts, by its global shape)."""
    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise WeightMismatchError(f"weight update: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if type(t).__name__ == "DTensor" and not dtensors:
            raise WeightMismatchError(
                f"weight update: {name!r} is a DTensor (an FSDP2 / tensor-parallel trainer's shard); send "
                "full tensors (DTensor.full_tensor()), or send each rank's shard with tpuray.rl.SyncTarget.send "
                "(docs/rl.md)"
            )
        if not t.is_floating_point():
            raise WeightMismatchError(
                f"weight update: {name!r} has dtype {t.dtype}; valid: a floating-point dtype"
            )
        out[name] = tuple(t.shape)
    return out


COLUMN_SPLIT = tuple(f"self_attn.{x}.{k}" for x in COLUMN_PARALLEL for k in ("weight", "bias")) + (
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
)
ROW_SPLIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def split_dim(name: str) -> int | None:
    """The dim an HF tensor is split on over tensor-parallel ranks: 0 (column-parallel: output
    features), 1 (row-parallel: input features) or None (replicated)."""
    if name.endswith(COLUMN_SPLIT):
        return 0
    if name.endswith(ROW_SPLIT):
        return 1
    return None


def part_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's chunk of `size` items, as `torch.chunk(world_size)[rank]` cuts it."""
    step = -(-size // world_size)
    return min(rank * step, size), min((rank + 1) * step, size)


Part = tuple[int, int, int]  # (dim, lo, hi): a rank holds [lo, hi) of a tensor along dim
PartFn = Callable[[str, tuple[int, ...], int, int], "Part | None"]  # (name, full shape, rank, world)


def embedded_part(name: str, full_shape: tuple[int, ...], rank: int, world_size: int) -> Part | None:
    """Rank's part of the full HF tensor `name` in the embedded engine's layout (`split_dim`,
    `part_range`): (dim, lo, hi), or None where the tensor is replicated (every rank holds all of it)."""
    dim = split_dim(name)
    if dim is None:
        return None
    return (dim, *part_range(full_shape[dim], rank, world_size))


def part_shape(full_shape: tuple[int, ...], part: Part | None) -> tuple[int, ...]:
    """The shape of a rank's part of a tensor of `full_shape` (the full shape where it is replicated)."""
    if part is None:
        return tuple(full_shape)
    dim, lo, hi = part
    return tuple(hi - lo if d == dim else n for d, n in enumerate(full_shape))


def cut(name: str, t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's part of the full HF tensor `name` (a view; the whole tensor where it is replicated)."""
    dim = split_dim(name)
    if dim is None or world_size == 1:
        return t
    lo, hi = part_range(t.shape[dim], rank, world_size)
    return t.narrow(dim, lo, hi - lo)


def fuse(parts: Mapping[str, Any], config: Mapping[str, Any], deferred: bool = False) -> dict[str, Any]:
    """One rank's HF-named parts (already cut for it) as the engine's fused tensors, keyed like
    `engine_tensors` (q/k/v -> qkv, gate/up -> gate_up); `deferred`: the fused ones as their row blocks
    (`tpuray.rl.rows.Rows`: the commit copies them into the weights, no copy here)."""

    def get(name: str) -> Any:
        return parts[name].detach()

    def cat(key: str, tensors: list[Any]) -> Any:
        return Rows.stack(tensors) if deferred else torch.cat(tensors)

    shards = {
        "embed": get("model.embed_tokens.weight"),
        "norm": get("model.norm.weight"),
        "lm_head": get("lm_head.weight" if "lm_head.weight" in parts else "model.embed_tokens.weight"),
    }
    for i in range(config["num_hidden_layers"]):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        shards[q + "in_norm"] = get(p + "input_layernorm.weight")
        shards[q + "post_norm"] = get(p + "post_attention_layernorm.weight")
        shards[q + "qkv"] = cat(q + "qkv", [get(p + f"self_attn.{x}.weight") for x in COLUMN_PARALLEL])
        shards[q + "o"] = get(p + "self_attn.o_proj.weight")
        shards[q + "gate_up"] = cat(
            q + "gate_up", [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]
        )
        shards[q + "down"] = get(p + "mlp.down_proj.weight")
        if _has_attention_bias(config):
            shards[q + "qkv_bias"] = cat(
                q + "qkv_bias", [get(p + f"self_attn.{x}.bias") for x in COLUMN_PARALLEL]
            )
    return shards


def shard_state(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any], rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """This rank's tensors (on the CPU, in the update's dtype), keyed like `engine_tensors`; `state` must
    have passed `check_state`."""
    return fuse({name: cut(name, t, rank, world_size) for name, t in state.items()}, config)


def engine_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The tensors of a `ShardedLlama` an update overwrites, keyed like `shard_state`."""
    tensors = {"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        for key, t in layer.items():
            tensors[f"layers.{i}.{key}"] = t
    return tensors


def copy_shards(model: Any, shards: Mapping[str, torch.Tensor | Rows]) -> int:
    """Overwrite the model's tensors in place (their storage, so compiled programs keep reading them) with
    `shards`; every name and shape was checked first, so a mismatch here raises before any write.
    Returns the bytes written."""
    dest = engine_tensors(model)
    if set(dest) != set(shards):
        raise WeightMismatchError(
            f"weight update: engine tensors {sorted(set(dest) ^ set(shards))} have no counterpart"
        )
    for key, t in shards.items():
        if dest[key].shape != t.shape:
            raise WeightMismatchError(
                f"weight update: shard {key!r} has shape {tuple(t.shape)}; the engine holds "
                f"{tuple(dest[key].shape)}"
            )
    written = 0
    with torch.no_grad():
        for key, t in shards.items():
            rows.write(dest[key], t)
            written += t.numel() * dest[key].element_size()
    return written


@dataclass(frozen=True)
class ShardedUpdate:
    """A weight update already cut per tensor-parallel rank: `refs[r]` is an ObjectRef of rank r's shards
    (keyed like `engine_tensors`). Made by `put_shards`; pass it to `RolloutEngine.update_weights`."""

    refs: tuple[Any, ...]
    nbytes: tuple[int, ...]  # bytes of each rank's shards

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.refs)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or a compact copy when it is a view of a bigger storage (pickling a view sends its whole
    storage)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def put_shards(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any], tensor_parallel_size: int
) -> ShardedUpdate:
    """Check a full HF state dict against the model of `config` (WeightMismatchError names the first
    mismatch), cut each tensor-parallel rank's shards and `ray.put` them, one object per rank. Run it
    where the state dict lives (e.g. a trainer's rank 0): only the refs travel from there."""
    import ray

    if not ray.is_initialized():  # ray.put would start a private local cluster the engine is not on
        raise RuntimeError("put_shards needs this process connected to the engine's Ray cluster (ray.init)")
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} is invalid; valid: an integer >= 1")
    check_state(shapes_of(state), config)
    refs, sizes = [], []
    for rank in range(tensor_parallel_size):
        shards = {
            k: _own_storage(t) for k, t in shard_state(state, config, rank, tensor_parallel_size).items()
        }
        refs.append(ray.put(shards))
        sizes.append(sum(t.numel() * t.element_size() for t in shards.values()))
    return ShardedUpdate(tuple(refs), tuple(sizes))


def check_shards(shards: Any, model: Any) -> None:
    """A rank's pre-cut shards against its model's tensors: WeightMismatchError naming the first missing,
    unknown or misshapen one (with the expected shape)."""
    if not isinstance(shards, Mapping):
        raise WeightMismatchError(f"a sharded update must hold a dict per rank, got {type(shards).__name__}")
    dest = engine_tensors(model)
    for key, t in shards.items():
        if key not in dest:
            raise WeightMismatchError(
                f"sharded weight update: unknown shard {key!r}; expected names like {next(iter(dest))!r}"
            )
        if not isinstance(t, torch.Tensor | Rows) or not t.is_floating_point():
            raise WeightMismatchError(f"sharded weight update: shard {key!r} is not a floating-point tensor")
        if tuple(t.shape) != tuple(dest[key].shape):
            raise WeightMismatchError(
                f"sharded weight update: shard {key!r} has shape {tuple(t.shape)}; expected {tuple(dest[key].shape)}"
            )
    missing = [k for k in dest if k not in shards]
    if missing:
        raise WeightMismatchError(
            f"sharded weight update: shard {missing[0]!r} (shape {tuple(dest[missing[0]].shape)}) is missing"
        )


Piece = tuple[int, torch.Tensor]  # (first row within the rollout rank's part, rows)
Into = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]  # HF name, part shape, dtype -> where


def join_pieces(
    received: list[dict[str, Piece]],
    config: Mapping[str, Any],
    rank: int,
    world_size: int,
    part: PartFn = embedded_part,
    deferred: bool = False,
    into: Into | None = None,
) -> dict[str, Any]:
    """Rollout rank `rank`'s part of each HF tensor (keyed by HF name) from the pieces every trainer rank
    sent it, in the layout of `part`; WeightMismatchError names the first missing, unknown, misshapen or
    incomplete tensor. A tensor whose part is empty (none of its rows on this rank) may be left out.
    `deferred`: parts joined from several pieces are their row blocks (as `fuse`). `into`: every part is
    copied into the tensor `into(name, part shape, dtype)` gives (e.g. its place in a bigger buffer)."""
    expected = expected_shapes(config)
    allowed = {**expected, **optional_names(config)}
    by_name: dict[str, list[Piece]] = {}
    for pieces in received:
        for name, piece in pieces.items():
            if name not in allowed:
                raise WeightMismatchError(f"weight sync: unknown tensor {name!r}")
            by_name.setdefault(name, []).append(piece)
    shapes = {n: part_shape(s, part(n, s, rank, world_size)) for n, s in allowed.items()}
    missing = [n for n in expected if n not in by_name and 0 not in shapes[n]]
    if missing:
        raise WeightMismatchError(
            f"weight sync: tensor {missing[0]!r} (shape {expected[missing[0]]}) is missing "
            f"({len(missing)} of {len(expected)})"
        )
    return {n: _join(n, ps, shapes[n], allowed[n], deferred, into) for n, ps in by_name.items()}


def assemble(
    received: list[dict[str, Piece]],
    config: Mapping[str, Any],
    rank: int,
    world_size: int,
    deferred: bool = False,
) -> dict[str, Any]:
    """Rollout rank `rank`'s fused shards (the embedded engine's) from the pieces every trainer rank
    sent it; WeightMismatchError names the first missing, unknown, misshapen or incomplete tensor
    (nothing is written). `deferred`: joined and fused as row blocks (as `fuse`), which stay views of
    the received pieces: commit or discard them before those are overwritten."""
    return fuse(join_pieces(received, config, rank, world_size, deferred=deferred), config, deferred)


def _join(
    name: str,
    pieces: list[Piece],
    shape: tuple[int, ...],
    full: tuple[int, ...],
    deferred: bool = False,
    into: Into | None = None,
) -> Any:
    pieces = sorted(pieces, key=lambda p: p[0])
    row = 0
    for start, t in pieces:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise WeightMismatchError(f"weight sync: a piece of {name!r} is not a floating-point tensor")
        if start != row or tuple(t.shape[1:]) != shape[1:]:
            raise WeightMismatchError(
                f"weight sync: {name!r} has a piece of shape {tuple(t.shape)} at row {start}; expected "
                f"rows from {row} of a part of shape {shape} (full shape {full})"
            )
        row += t.shape[0]
    if row != shape[0]:
        raise WeightMismatchError(f"weight sync: {name!r} has {row} of its part's {shape[0]} rows")
    if into is not None:
        dest = into(name, shape, pieces[0][1].dtype)
        for start, t in pieces:
            dest[start : start + t.shape[0]].copy_(t)
        return dest
    if len(pieces) == 1:
        return pieces[0][1]
    return Rows(pieces) if deferred else torch.cat([t for _, t in pieces])
