"""The `tpu_dist` weight-sync transport: a process group spanning a trainer's workers and a rollout
engine's workers (both slices), over which each trainer rank sends every rollout rank the pieces of its
tensor-parallel part (`tpuray.rl.sync.trainer_pieces`) point to point. Only the pieces' metadata (name,
first row, shape, dtype) travels through the RL run's mailbox actor, and the driver checks it against
the engine's model before any byte moves (`check_metas`): a name or shape mismatch is refused before
anything is sent or overwritten.

The group is built with torch.distributed: the backend "tpu_dist" (on emulated hosts tpuray's
gloo-backed group, `tpuray.runtime.dist`; on TPU hosts the one torch_tpu registers) created by its
registered creator on a `PrefixStore` of a `TCPStore` the driver hosts (`Rendezvous`). Ranks: trainer
rank r is group rank r, rollout rank q is group rank `trainer_world_size + q`. Every process joins at its
first transfer (`member`) and keeps the group until it exits. A restarted trainer (attempt n, new worker
processes) forms a new group on the same store under its own prefix (`Channel.generation` = n): the
engine's workers join it at their next transfer (the old one is left to their exit).
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from tpuray.rl.weights import WeightMismatchError

BACKEND = "tpu_dist"
PREFIX = "tpuray-rl-sync"
TAG = 0
# (name, first row within the rollout rank's part, shape, dtype name, byte offset in the flat buffer)
Meta = tuple[str, int, tuple[int, ...], str, int]


@dataclass(frozen=True)
class Channel:
    """Where the transport's group meets (the driver's TCPStore) and its shape; picklable."""

    host: str
    port: int
    trainer_world_size: int
    tensor_parallel_size: int
    timeout_s: float
    generation: int = 0  # the trainer attempt: a restarted trainer forms a new group (own store prefix)

    @property
    def world_size(self) -> int:
        return self.trainer_world_size + self.tensor_parallel_size

    def rollout_rank(self, q: int) -> int:
        return self.trainer_world_size + q


class Rendezvous:
    """The driver's TCPStore for one RL run's group (closed with the run)."""

    def __init__(self, trainer_world_size: int, tensor_parallel_size: int, timeout_s: float) -> None:
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self.store: Any = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.channel = Channel(host, self.store.port, trainer_world_size, tensor_parallel_size, timeout_s)

    def close(self) -> None:
        self.store = None


# -- packing ------------------------------------------------------------------------------------------
def pack(pieces: dict[str, tuple[int, torch.Tensor]]) -> tuple[list[Meta], torch.Tensor | None]:
    """The pieces for one rollout rank as their metadata and one flat byte buffer (None when empty)."""
    metas: list[Meta] = []
    flat: list[torch.Tensor] = []
    offset = 0
    for name, (start, t) in pieces.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        metas.append((name, start, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset))
        flat.append(raw)
        offset += raw.numel()
    return metas, (torch.cat(flat) if flat else None)


def nbytes_of(metas: list[Meta]) -> int:
    return sum(_dtype(d).itemsize * _numel(s) for _, _, s, d, _ in metas)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise WeightMismatchError(f"weight sync: dtype {name!r} is not a floating-point torch dtype")
    return dtype


def unpack(metas: list[Meta], flat: torch.Tensor) -> dict[str, tuple[int, torch.Tensor]]:
    """The pieces `pack` packed (views of `flat`)."""
    out = {}
    for name, start, shape, dtype, offset in metas:
        dt = _dtype(dtype)
        size = _numel(shape) * dt.itemsize
        out[name] = (start, flat[offset : offset + size].view(dt).reshape(shape))
    return out


def meta_pieces(metas: list[Meta]) -> dict[str, tuple[int, torch.Tensor]]:
    """The pieces as data-less ("meta" device) tensors, for checking names and shapes before transfer."""
    return {n: (start, torch.empty(shape, dtype=_dtype(d), device="meta")) for n, start, shape, d, _ in metas}


def check_metas(per_rank: list[list[list[Meta]]], config: Mapping[str, Any]) -> None:
    """Check what every trainer rank offers every rollout rank (`per_rank[q]`: the metadata lists from
    each sender) against the engine's model: WeightMismatchError names the first missing, unknown or
    misshapen tensor; no tensor data is involved."""
    from tpuray.rl.weights import assemble

    world = len(per_rank)
    for q, offers in enumerate(per_rank):
        assemble([meta_pieces(m) for m in offers], config, q, world)


# -- the group ----------------------------------------------------------------------------------------
class SyncGroup:
    """This process's member of the transport's process group (see the module docstring)."""

    def __init__(self, channel: Channel, rank: int) -> None:
        import torch.distributed as dist

        plugin = dist.Backend._plugins.get(BACKEND.upper())
        if plugin is None:
            raise RuntimeError(
                f"weight_sync='tpu_dist': backend {BACKEND!r} is not registered in this process (a worker "
                "of an emulated or real TPU slice has it)"
            )
        timeout = timedelta(seconds=channel.timeout_s)
        store = dist.TCPStore(channel.host, channel.port, is_master=False, timeout=timeout)
        self.channel = channel
        self.rank = rank
        prefix = f"{PREFIX}/{channel.generation}"
        self.pg: Any = plugin.creator_fn(dist.PrefixStore(prefix, store), rank, channel.world_size, timeout)
        self.transfer_s = 0.0  # seconds in the last send_all / recv_all (the collective alone)

    def send_all(self, flats: list[torch.Tensor | None]) -> None:
        """Send flats[q] to rollout rank q (None: nothing for it) and wait until all went."""
        import time

        t = time.perf_counter()
        works = [
            self.pg.send([f], self.channel.rollout_rank(q), TAG) for q, f in enumerate(flats) if f is not None
        ]
        for w in works:
            w.wait()
        self.transfer_s = time.perf_counter() - t

    def recv_all(self, offers: list[tuple[int, list[Meta]]]) -> list[dict[str, tuple[int, torch.Tensor]]]:
        """Receive each (trainer rank, metadata) offer's flat buffer; the pieces, in order."""
        import time

        t = time.perf_counter()
        bufs = [torch.empty(nbytes_of(m), dtype=torch.uint8) for _, m in offers]
        works = [self.pg.recv([b], src, TAG) for (src, _), b in zip(offers, bufs, strict=True)]
        for w in works:
            w.wait()
        self.transfer_s = time.perf_counter() - t
        return [unpack(m, b) for (_, m), b in zip(offers, bufs, strict=True)]

    def close(self) -> None:
        """Stop the group's backend on this thread (tpu_dist's gloo left running to interpreter exit
        can abort the process there: runtime/dist.py)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


_MEMBERS: dict[tuple[str, int, int], SyncGroup] = {}  # this process's groups, by rendezvous address


def member(channel: Channel, rank: int) -> SyncGroup:
    """This process's member of `channel`'s group as `rank` (joined at the first call: blocks until every
    rank of the group joined; closed when the process exits)."""
    key = (channel.host, channel.port, channel.generation)
    if key not in _MEMBERS:
        if not _MEMBERS:
            atexit.register(close_all)
        for old in [k for k in _MEMBERS if k[:2] == key[:2] and k[2] < key[2]]:
            _MEMBERS.pop(old).close()  # a lost trainer attempt's group
        _MEMBERS[key] = SyncGroup(channel, rank)
    return _MEMBERS[key]


def close_all() -> None:
    """Close this process's groups (at exit)."""
    while _MEMBERS:
        _MEMBERS.popitem()[1].close()
