"""Cutting a weight update where it lives, before any transport.

- A full state dict: `shard_state` cuts one rollout rank's fused shards from it (`cut`, then `fuse`);
  `put_shards` puts every rank's in Ray's object store (a `ShardedUpdate`), so that each engine rank
  receives only its part.
- A trainer rank (`trainer_pieces`): the pieces of each rollout tensor-parallel rank's part
  (`tpuray.rl.weights.layout.embedded_part`, or vLLM's layout: `tpuray.rl.weights.vllm_layout.vllm_part`)
  that the rank holds, cut from its tensors where they live. `tpuray.rl.weights.join.join_pieces` is the
  rollout rank's side: it joins the pieces every trainer rank sent into its parts.
  - sharded trainer (FSDP2 / DTensor with `Shard(0)` on a 1-D mesh): every rank cuts from the rows it holds;
  - replicated trainer (DDP, or one worker): rank 0 cuts the full state, the other ranks nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tpuray.rl.weights.check import WeightMismatchError, check_state, shapes_of
from tpuray.rl.weights.layout import PartFn, Piece, embedded_part, fuse, part_range, split_dim


def cut(name: str, t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's part of the full HF tensor `name` (a view; the whole tensor where it is replicated)."""
    dim = split_dim(name)
    if dim is None or world_size == 1:
        return t
    lo, hi = part_range(t.shape[dim], rank, world_size)
    return t.narrow(dim, lo, hi - lo)


def shard_state(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any], rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """This rank's tensors (on the CPU, in the update's dtype), keyed like `engine_tensors`; `state` must
    have passed `check_state`."""
    return fuse({name: cut(name, t, rank, world_size) for name, t in state.items()}, config)


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


def _row_offset(name: str, t: torch.Tensor, rank: int) -> tuple[torch.Tensor, int] | None:
    """(this rank's local rows, where they live: on the device, their first global row), or None when
    another rank sends the tensor (replicated: rank 0 sends it). A DTensor must be `Shard(0)` or
    `Replicate()` on a 1-D mesh (what FSDP2's `fully_shard` makes)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return (t.detach(), 0) if rank == 0 else None
    local = t.to_local().detach()
    if dtensor_placement(name, t) == Replicate():
        return (local, 0) if rank == 0 else None
    lo, hi = part_range(t.shape[0], t.device_mesh.get_local_rank(), t.device_mesh.size())
    if local.shape[0] != hi - lo:
        raise WeightMismatchError(
            f"weight sync: {name!r}'s local shard has {local.shape[0]} rows; Shard(0) over "
            f"{t.device_mesh.size()} ranks gives rows [{lo}, {hi})"
        )
    return local, lo


def dtensor_placement(name: str, t: Any) -> Any:
    """The one placement of DTensor `name` (`t`): `Shard(0)` or `Replicate()` on a 1-D mesh (what FSDP2's
    `fully_shard` makes), else WeightMismatchError naming it."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    if t.device_mesh.ndim != 1 or placements[0] not in (Shard(0), Replicate()):
        raise WeightMismatchError(
            f"weight sync: {name!r} is a DTensor with placements {placements} on a {t.device_mesh.ndim}-D "
            "mesh; valid: Shard(0) or Replicate() on a 1-D mesh (FSDP2's fully_shard)"
        )
    return placements[0]


def trainer_pieces(
    state: Mapping[str, torch.Tensor],
    rank: int,
    tensor_parallel_size: int,
    part: PartFn = embedded_part,
    compact: bool = True,
) -> list[dict[str, Piece]]:
    """For each rollout rank, the pieces of its part (in the layout of `part`) that this trainer rank
    holds (name -> (first row within the part, rows)); names are HF names, shapes are checked by the
    receiver. `compact`: each piece a host tensor of its own storage (to be put in the object store),
    else a view of the rank's rows where they live (to be packed: `tpuray.rl.sync.collective.pack` copies it
    to the host once). Either way a piece's bytes are copied once, never the rank's whole state first."""
    out: list[dict[str, Piece]] = [{} for _ in range(tensor_parallel_size)]
    for name, t in state.items():
        held = _row_offset(name, t, rank)
        if held is None:
            continue
        pieces = row_pieces(name, *held, tuple(t.shape), tensor_parallel_size, part, compact)
        for r, piece in enumerate(pieces):
            if piece is not None:
                out[r][name] = piece
    return out


def row_pieces(
    name: str,
    local: torch.Tensor,
    first_row: int,
    full_shape: tuple[int, ...],
    tensor_parallel_size: int,
    part: PartFn = embedded_part,
    compact: bool = True,
) -> list[Piece | None]:
    """For each rollout rank, the piece of its part of tensor `name` (of `full_shape`) within `local`,
    the rows [first_row, first_row + len(local)) a trainer rank holds; None where they hold none of it.
    `compact`: as `trainer_pieces`."""
    a, b = first_row, first_row + local.shape[0]
    out: list[Piece | None] = []
    for r in range(tensor_parallel_size):
        p = part(name, full_shape, r, tensor_parallel_size)
        rows = (p[1], p[2]) if p is not None and p[0] == 0 else (0, full_shape[0])
        lo, hi = max(rows[0], a), min(rows[1], b)
        if lo >= hi:
            out.append(None)
            continue
        piece = local[lo - a : hi - a]
        if p is not None and p[0] == 1:
            piece = piece[:, p[1] : p[2]]
        out.append((lo - rows[0], _on_host(piece) if compact else piece))
    return out


def _on_host(piece: torch.Tensor) -> torch.Tensor:
    """A host tensor of its own storage holding `piece` (a device tensor's piece: one copy to the host;
    a host view: copied out of its bigger storage, which pickling would send whole)."""
    return _own_storage(piece.cpu().contiguous())


def model_state(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """HF-named state of a trainer's model: a state dict, a plain / FSDP2 module, or a DDP / FSDP1
    wrapper (its `.module`)."""
    if isinstance(model, Mapping):
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a state dict, got {type(model).__name__}")
    inner = getattr(model, "module", None)
    return (inner if isinstance(inner, torch.nn.Module) else model).state_dict()
