"""Hugging Face tensors -> vLLM's tensor-parallel layout (vLLM 0.29, Llama family), for weight updates
that send each vLLM worker only its part (issue 23).

vLLM's tensor-parallel rank r of W holds, of each HF tensor, one block along one dim:

- q_proj, gate_proj, up_proj (and q/k/v biases): rank r's W-th of the rows (heads for q);
- k_proj, v_proj: rank r's W-th of the kv heads, or, when there are fewer kv heads than ranks, the
  whole head r // (W / kv_heads), which W / kv_heads ranks share (`QKVParallelLinear`);
- o_proj, down_proj: rank r's W-th of the columns (`RowParallelLinear`);
- embed_tokens, lm_head: rows [min(r P, V), min((r + 1) P, V)) of the V real ones, P = pad64(V) / W
  (`VocabParallelEmbedding` pads the vocab to a multiple of 64, then splits it evenly); a model with
  tied embeddings has no lm_head of its own (vLLM skips the name): its part is empty;
- norms and o_proj's bias: replicated.

`vllm_part` gives that block as (dim, lo, hi), in the form `tpuray.rl.weights.layout` uses for the embedded
engine (`embedded_part`), so `trainer_pieces`, `join_pieces` and the transports work unchanged with it (pass
`functools.partial(vllm_part, config=config)` as their `part`).

vLLM 0.29's loaders cannot take an already-cut block: they always narrow what they are given by the
worker's rank (weight_loader_v2, and the embedding's check of the full vocab). So a worker hands them,
per HF name, a "sparse full" tensor (`SparseParts`): the full shape, allocated
uninitialized (no pages are committed for the rest), with only the rank's block written; the loaders read
exactly that block, so the result equals loading the full tensor. A worker joins the received pieces
straight into those blocks (`SparseParts`), in buffers it keeps from one update to the next.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tpuray.rl.weights.buffers import BufferPool
from tpuray.rl.weights.layout import ROW_SPLIT, Part, allowed_shapes

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
HEAD_ROWS = tuple(f"self_attn.q_proj.{k}" for k in ("weight", "bias"))
KV_ROWS = tuple(f"self_attn.{x}.{k}" for x in ("k_proj", "v_proj") for k in ("weight", "bias"))
MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def vllm_part(
    name: str, full_shape: tuple[int, ...], rank: int, world_size: int, config: Mapping[str, Any]
) -> Part | None:
    """Rank's part of the full HF tensor `name` (of `full_shape`) in vLLM's tensor-parallel layout:
    (dim, lo, hi), or None where it is replicated (norms, o_proj's bias). A tied model's lm_head gets an
    empty part. ValueError where vLLM would refuse the model for this world size."""
    heads = config["num_attention_heads"]
    if name.endswith(HEAD_ROWS):
        return (0, *_even(full_shape[0], heads, rank, world_size, name))
    if name.endswith(KV_ROWS):
        kv_heads = config.get("num_key_value_heads") or heads
        return (0, *_kv_rows(name, full_shape[0], kv_heads, rank, world_size))
    if name.endswith(MLP_ROWS):
        return (0, *_even(full_shape[0], full_shape[0], rank, world_size, name))
    if name.endswith(ROW_SPLIT):
        units = heads if "self_attn" in name else full_shape[1]
        return (1, *_even(full_shape[1], units, rank, world_size, name))
    if name == "lm_head.weight" and config.get("tie_word_embeddings", False):
        return (0, 0, 0)
    if name in VOCAB_ROWS:
        return (0, *vocab_rows(full_shape[0], rank, world_size))
    return None


def vocab_rows(vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of the real vocab rows rank holds of an embedding or lm_head (P = pad64(vocab) / W rows
    each, padding last)."""
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    if padded % world_size:
        raise ValueError(f"vLLM cannot split a vocab padded to {padded} over {world_size} ranks")
    per = padded // world_size
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def _even(size: int, units: int, rank: int, world_size: int, name: str) -> tuple[int, int]:
    """[lo, hi) of rank's W-th of `size` items grouped in `units` (heads, or single rows)."""
    if units % world_size:
        raise ValueError(f"{name}: vLLM cannot split {units} heads or rows over {world_size} ranks")
    step = size // world_size
    return rank * step, (rank + 1) * step


def _kv_rows(name: str, size: int, kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's rows of k_proj or v_proj: an even split, or one whole shared head when there
    are fewer kv heads than ranks."""
    if kv_heads >= world_size:
        return _even(size, kv_heads, rank, world_size, name)
    if world_size % kv_heads:
        raise ValueError(f"{name}: vLLM cannot share {kv_heads} kv heads among {world_size} ranks")
    head_rows = size // kv_heads
    head = rank // (world_size // kv_heads)
    return head * head_rows, (head + 1) * head_rows


class SparseParts:
    """One vLLM rank's parts of an update, joined straight into "sparse full" tensors (one copy from the
    received pieces): pass `block` as `tpuray.rl.weights.join.join_pieces(..., into=...)`, then hand
    `tensors()` to vLLM's `load_weights` / `reload_weights`. `buffers`: the full tensors are the
    owner's reused buffers (valid until the next update; only the blocks' pages are ever written);
    `fill`: filled first instead (a test's NaN)."""

    def __init__(
        self,
        config: Mapping[str, Any],
        rank: int,
        world_size: int,
        buffers: BufferPool | None = None,
        fill: float | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.buffers = buffers
        self.fill = fill
        self.shapes = allowed_shapes(config)
        self.full: dict[str, torch.Tensor] = {}  # HF name -> its sparse full tensor, in join order

    def block(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where rank's part of `name` (of `shape`) goes: its block in a new sparse full tensor."""
        full_shape = self.shapes[name]
        part = vllm_part(name, full_shape, self.rank, self.world_size, self.config)
        buf = self.full[name] = _full_buffer(full_shape, part, dtype, self.fill, self.buffers, name)
        out = buf if part is None else _narrow(buf, part)
        assert tuple(out.shape) == tuple(shape), (name, tuple(out.shape), shape)
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, sparse full tensor) of every part joined so far."""
        return iter(self.full.items())


def _narrow(buf: torch.Tensor, part: Part) -> torch.Tensor:
    return buf.narrow(part[0], part[1], part[2] - part[1])


def _full_buffer(
    shape: tuple[int, ...],
    part: Part | None,
    dtype: torch.dtype,
    fill: float | None,
    buffers: BufferPool | None = None,
    name: str = "",
) -> torch.Tensor:
    """An uninitialized tensor of `shape` (`buffers`' under `name`; `fill`ed where given). A column block
    (dim 1) is contiguous in a transposed buffer: only its pages get written."""
    column = part is not None and part[0] == 1
    alloc = tuple(shape[::-1]) if column else tuple(shape)
    if fill is not None:
        buf = torch.full(alloc, fill, dtype=dtype)
    elif buffers is not None:
        buf = buffers.like(("sparse", name), alloc, dtype)
    else:
        buf = torch.empty(alloc, dtype=dtype)
    return buf.t() if column else buf
