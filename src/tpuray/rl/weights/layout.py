"""Hugging Face parameter names and shapes, and the embedded engine's tensor-parallel layout, in one place.

The embedded engine (`tpuray.serve.llm.engine.embedded.model.ShardedLlama`) holds each layer's q/k/v as one
fused `qkv` tensor and gate/up as one `gate_up`, split over the tensor-parallel ranks Megatron-style:
column-parallel tensors (q, k, v, gate, up and their biases) take this rank's chunk of dim 0, row-parallel
ones (o_proj, down_proj) this rank's chunk of dim 1; embeddings, norms and lm_head are replicated. This
module mirrors those rules so that an update from a trainer lands in every rank's tensors exactly as
loading the same checkpoint from disk would:

- `expected_shapes(config)`: every HF name a full state dict of the model has, with its shape;
- `embedded_part(name, full_shape, rank, world_size)`: a rank's part of one HF tensor, as (dim, lo, hi)
  (vLLM's layout: `tpuray.rl.weights.vllm_layout.vllm_part`);
- `fuse(parts, config)`: one rank's HF-named parts as the engine's fused tensors, keyed like
  `engine_tensors(model)`, the engine's own tensors (what an update overwrites in place).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tpuray.rl.weights.rows import Rows

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj")  # fused, in this order, into "qkv"


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


def allowed_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every name an update of this model may carry, with its shape (`expected_shapes`, `optional_names`)."""
    return {**expected_shapes(config), **optional_names(config)}


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
Piece = tuple[int, torch.Tensor]  # (first row within a rollout rank's part, rows): what a sender sends


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


def fuse(parts: Mapping[str, Any], config: Mapping[str, Any], deferred: bool = False) -> dict[str, Any]:
    """One rank's HF-named parts (already cut for it) as the engine's fused tensors, keyed like
    `engine_tensors` (q/k/v -> qkv, gate/up -> gate_up); `deferred`: the fused ones as their row blocks
    (`Rows`: the commit copies them into the weights, no copy here)."""

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


def engine_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The tensors of a `ShardedLlama` an update overwrites, keyed like `fuse`'s."""
    tensors = {"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        for key, t in layer.items():
            tensors[f"layers.{i}.{key}"] = t
    return tensors
