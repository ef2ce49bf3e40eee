"""Colocated weight hand-over without the object store (`RLConfig(placement="colocated",
weight_sync="tpu_dist")`): each trainer rank builds its own rollout rank's shards where the trainer's
tensors live (on the chip), exchanging rows with the other ranks over the trainer's own process group,
and leaves them in its process for the engine rank that runs there (`rank_shards`; for colocated vLLM its
unfused part of each tensor in vLLM's layout, `rank_pieces`, which vLLM's worker joins as it joins
received pieces); only a `Handed` marker passes the mailbox and the driver. The engine rank takes the shards as they are (`RunnerWeights.stage_shards(...,
owned=True)`): awake it copies them into its weights on the device; asleep it keeps them and adopts them
as its weights at `wake_up` (no copy). Nothing crosses the host link, and no object is put.

Per tensor, on every trainer rank (all ranks run `rank_shards` together, the same tensors in the same
order):
- a `Shard(0)` DTensor (FSDP2) is gathered whole (`full_tensor()`: an all-gather on the trainer's
  group), a `Replicate()` one is read where it is;
- a plain tensor is rank 0's (as over the other transports: DDP replicas, or one worker), broadcast to the
  other ranks when there are several;
then the rank cuts its tensor-parallel part (`tpuray.rl.weights.cut.row_pieces`) into a tensor of its own (the
whole tensor is freed before the next) and fuses them as the engine holds them.

The shards live only in the sender's process: a trainer restart (new processes) must send its restored
weights again (`rl.send(model, version=start)` before its first `rl.batch`, docs/rl.md "Colocated
restarts"); an engine that looks for them in another process gets `HandOverLost` (the run's
`UpdateLostError` path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tpuray.rl.sync.collective import TransferError
from tpuray.rl.sync.local import local
from tpuray.rl.weights.check import WeightMismatchError, check_state, shapes_of
from tpuray.rl.weights.cut import dtensor_placement, row_pieces
from tpuray.rl.weights.layout import PartFn, Piece, embedded_part, fuse


class HandOverLost(TransferError):
    """A colocated update's shards are not in this engine rank's process: the trainer rank that handed
    them over ran in another process (lost with its worker), or they were taken already."""


@dataclass(frozen=True)
class Handed:
    """What a colocated trainer rank puts in the mailbox for its own rollout rank instead of ObjectRefs:
    the shards wait in its process under `key`."""

    key: str


def keep(key: str, update: dict[str, Any]) -> None:
    """Leave `update` (`rank_shards`' or `rank_pieces`') for this process's engine rank under `key`, in the
    process's `LocalSync` (an earlier, untaken hand-over goes)."""
    handed = local().handed
    handed.clear()
    handed[key] = update


def take(markers: list[Any]) -> dict[str, Any]:
    """The update a `Handed` marker names, taken (HandOverLost when this process holds none under it)."""
    if len(markers) != 1 or not isinstance(markers[0], Handed):
        raise WeightMismatchError(f"a colocated hand-over is one Handed marker per rank, got {markers!r}")
    shards = local().handed.pop(markers[0].key, None)
    if shards is None:
        raise HandOverLost(
            f"the colocated update {markers[0].key!r} is not in this process: the trainer rank that handed "
            "it over is gone (its worker was lost) or it was taken already"
        )
    return shards


def is_handed(refs: Any) -> bool:
    """Whether a TrainerUpdate's refs for one rank are a colocated hand-over (one `Handed` marker)."""
    return isinstance(refs, list | tuple) and len(refs) == 1 and isinstance(refs[0], Handed)


def rank_shards(
    state: Mapping[str, torch.Tensor], rank: int, world_size: int, config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """This trainer rank's rollout rank's shards (keyed like `tpuray.rl.weights.layout.engine_tensors`, where
    the trainer's tensors live), from the trainer's HF-named `state`: its part of each tensor in the
    embedded engine's layout (`rank_pieces`), fused as the engine holds them. Every rank of the trainer
    calls it with the same tensors. A name or shape mismatch with the engine's model (`config`: its
    config.json) raises WeightMismatchError on every rank before any collective."""
    pieces = rank_pieces(state, rank, world_size, config, embedded_part)
    return fuse({name: t for name, (_, t) in pieces.items()}, config)


def rank_pieces(
    state: Mapping[str, torch.Tensor], rank: int, world_size: int, config: Mapping[str, Any], part: PartFn
) -> dict[str, Piece]:
    """This trainer rank's rollout rank's part of each tensor in the layout of `part` (vLLM's:
    `tpuray.rl.weights.vllm_layout.vllm_part`), unfused, as the one piece a sender holding every row would
    send it (`tpuray.rl.weights.cut.row_pieces`: its first row is 0), in a tensor of its own; for vLLM's
    worker, which joins it as it joins received pieces (`join_pieces`). Checked as `rank_shards`."""
    check_state(shapes_of(state, dtensors=True), config)
    out: dict[str, Piece] = {}
    for name, t in state.items():
        whole = _whole(name, t, rank, world_size)
        piece = row_pieces(name, whole, 0, tuple(whole.shape), world_size, part, compact=False)[rank]
        if piece is not None:
            out[name] = (piece[0], _own(piece[1]))
    return out


def _whole(name: str, t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The full tensor `name` on this rank (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        if dtensor_placement(name, t) == Replicate():
            return t.to_local().detach()
        return t.full_tensor().detach()
    if world_size == 1:
        return t.detach()
    import torch.distributed as dist

    whole = (
        t.detach().contiguous() if rank == 0 else torch.empty_like(t, memory_format=torch.contiguous_format)
    )
    dist.broadcast(whole, src=0)
    return whole


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of its own storage holding `t` (never the trainer's tensor, nor a view that
    would keep a whole gathered tensor alive)."""
    return t.clone(memory_format=torch.contiguous_format)
