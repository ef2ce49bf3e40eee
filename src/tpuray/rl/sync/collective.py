"""The `tpu_dist` weight-sync transport: a process group spanning a trainer's workers and a rollout
engine's workers (both slices), over which each trainer rank sends every rollout rank the pieces of its
tensor-parallel part (`tpuray.rl.weights.cut.trainer_pieces`) point to point, as one flat buffer per pair (in
messages of at most `Channel.chunk_bytes`: 64 MiB unless the rendezvous says otherwise). Only
each buffer's `Offer` (the pieces' metadata: name, first row, shape, dtype, offset; and its size) travels
through the RL run's mailbox actor to the driver, which hands the offers to the engine's workers. A
trainer rank sends as soon as its offer is in the mailbox (the driver is not in the data's path); each
rollout rank receives every buffer offered to it (sized by the offer, whatever the metadata says), then
checks the pieces against the engine's model while assembling its part (`tpuray.rl.weights.join.assemble`):
a name, shape or dtype mismatch is refused after the transfer, before anything is staged or written.

The group is built with torch.distributed on a `PrefixStore` of a `TCPStore` the driver hosts
(`Rendezvous`), as a gloo group (`SyncGroup`): the buffers are host tensors, which "tpu_dist" refuses on
real TPU hosts (TorchTPU's takes only tensors on the chip: "expected tensor to be on tpu, got cpu" on a
v5e, tests/real_tpu/test_runtime.py) and on emulated ones (which mirror it). Gloo moves them over the
hosts' network (DCN on real slices), as the emulated tpu_dist's gloo does underneath. Ranks: trainer rank r is
group rank r, rollout rank q is group rank `trainer_world_size + q`. Every process joins at its first transfer
(`member`) and keeps the group until it exits (`tpuray.rl.sync.local`). A restarted trainer (attempt n, new
worker processes) forms a new group on the same store under its own prefix (`Channel.generation` = n): the
engine's workers join it at their next transfer and close the lost attempt's group (`member`); so does a
rollout engine that replaced a failed one (`Channel.engine`, its incarnation), with the trainer's ranks, which
close their group with the lost engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch

from tpuray.rl.sync.local import local
from tpuray.rl.weights.buffers import BufferPool
from tpuray.rl.weights.check import WeightMismatchError

PREFIX = "tpuray-rl-sync"
CHUNK_BYTES = 64 << 20  # default most bytes of one message (Channel.chunk_bytes)
# (name, first row within the rollout rank's part, shape, dtype name, byte offset in the flat buffer)
Meta = tuple[str, int, tuple[int, ...], str, int]


class TransferError(RuntimeError):
    """A buffer offered to this rollout rank did not arrive: the connection to its sender broke (the
    trainer rank died, or its host), so the update is lost; the engine's workers staged nothing."""


class Offer(NamedTuple):
    """What trainer rank `sender` sends one rollout rank: one flat buffer of `nbytes` holding the pieces
    `metas` describe (`pack`)."""

    sender: int
    metas: list[Meta]
    nbytes: int


@dataclass(frozen=True)
class Channel:
    """Where the transport's group meets (the driver's TCPStore) and its shape; picklable."""

    host: str
    port: int
    trainer_world_size: int
    tensor_parallel_size: int
    timeout_s: float
    generation: int = 0  # the trainer attempt: a restarted trainer forms a new group (own store prefix)
    engine: int = 0  # the rollout engine's incarnation: so does a replaced engine
    chunk_bytes: int = CHUNK_BYTES  # a buffer moves as messages of at most this many bytes, tagged 0, 1, ...

    @property
    def world_size(self) -> int:
        return self.trainer_world_size + self.tensor_parallel_size

    def rollout_rank(self, q: int) -> int:
        return self.trainer_world_size + q


class Rendezvous:
    """The driver's TCPStore for one RL run's group (closed with the run)."""

    def __init__(
        self,
        trainer_world_size: int,
        tensor_parallel_size: int,
        timeout_s: float,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        import ray
        import torch.distributed as dist

        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} is invalid; valid: a positive number of bytes")
        host = ray.util.get_node_ip_address()
        self.store: Any = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.channel = Channel(
            host,
            self.store.port,
            trainer_world_size,
            tensor_parallel_size,
            timeout_s,
            chunk_bytes=chunk_bytes,
        )

    def close(self) -> None:
        self.store = None


# -- packing ------------------------------------------------------------------------------------------
ALIGN = 8  # bytes: every piece starts at a multiple, so that a view of the buffer as its dtype is legal


def pack(
    pieces: dict[str, tuple[int, torch.Tensor]], buffers: BufferPool | None = None, key: Any = None
) -> tuple[list[Meta], torch.Tensor | None]:
    """The pieces for one rollout rank as their metadata and one flat byte buffer (None when empty), each
    piece copied in once, from the host or the device (a strided device piece is made contiguous there
    first); into `buffers.flat(key, ...)`, reused, where `buffers` is given."""
    metas: list[Meta] = []
    offset = 0
    for name, (start, t) in pieces.items():
        metas.append((name, start, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if not metas:
        return metas, None
    flat = buffers.flat(key, offset) if buffers is not None else torch.empty(offset, dtype=torch.uint8)
    for (_, t), (_, _, shape, _, at) in zip(pieces.values(), metas, strict=True):
        size = t.numel() * t.element_size()
        src = t.detach() if t.device.type == "cpu" else t.detach().contiguous()
        flat[at : at + size].view(t.dtype).view(shape).copy_(src)
    return metas, flat


def chunks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`flat` as consecutive views of at most `size` bytes: the messages one buffer moves in."""
    return [flat[at : at + size] for at in range(0, flat.numel(), size)]


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
    """The pieces `pack` packed (views of `flat`); WeightMismatchError for a dtype that is not a
    floating-point torch dtype or a piece outside the buffer."""
    out = {}
    for name, start, shape, dtype, offset in metas:
        dt = _dtype(dtype)
        size = _numel(shape) * dt.itemsize
        if offset < 0 or offset + size > flat.numel():
            raise WeightMismatchError(
                f"weight sync: {name!r} of shape {tuple(shape)} at byte {offset} lies outside the "
                f"{flat.numel()}-byte buffer it came in"
            )
        out[name] = (start, flat[offset : offset + size].view(dt).reshape(shape))
    return out


# -- the group ----------------------------------------------------------------------------------------
class SyncGroup:
    """This process's member of the transport's process group (see the module docstring)."""

    def __init__(self, channel: Channel, rank: int) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=channel.timeout_s)
        store = dist.TCPStore(channel.host, channel.port, is_master=False, timeout=timeout)
        self.channel = channel
        self.rank = rank
        prefix = f"{PREFIX}/{channel.generation}/{channel.engine}"
        # gloo on every host: the buffers are host tensors (the module docstring)
        self.pg: Any = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store), rank, channel.world_size, timeout
        )
        self.transfer_s = 0.0  # seconds in the last send_all / recv_all (the collective alone)
        self.buffers = BufferPool()  # what recv_all receives into, by sender

    def send_all(self, flats: list[torch.Tensor | None]) -> None:
        """Send flats[q] to rollout rank q (None: nothing for it), in chunks, and wait until all went."""
        import time

        t = time.perf_counter()
        size = self.channel.chunk_bytes
        works = [
            self.pg.send([c], self.channel.rollout_rank(q), tag)
            for q, f in enumerate(flats)
            if f is not None
            for tag, c in enumerate(chunks(f, size))
        ]
        for w in works:
            w.wait()
        self.transfer_s = time.perf_counter() - t

    def recv_all(self, offers: list[Offer]) -> list[dict[str, tuple[int, torch.Tensor]]]:
        """Receive every offer's flat buffer, each chunk of each (all of them, so that no sender waits),
        then its pieces in order; WeightMismatchError where an offer's metadata does not describe its
        buffer, TransferError where a buffer did not arrive whole (its sender's connection broke, before
        or during the transfer)."""
        import time

        t = time.perf_counter()
        # reused from update to update: staged views of them end at commit
        bufs = [self.buffers.flat(o.sender, o.nbytes) for o in offers]
        size = self.channel.chunk_bytes
        works = [
            (o, self._arriving(o, lambda o=o, c=c, tag=tag: self.pg.recv([c], o.sender, tag)))
            for o, b in zip(offers, bufs, strict=True)
            for tag, c in enumerate(chunks(b, size))
        ]
        for o, w in works:
            self._arriving(o, w.wait)
        self.transfer_s = time.perf_counter() - t
        return [unpack(o.metas, b) for o, b in zip(offers, bufs, strict=True)]

    @staticmethod
    def _arriving(offer: Offer, step: Any) -> Any:
        """`step()` of receiving `offer`'s buffer (posting or waiting); TransferError where it fails (gloo
        raises a bare RuntimeError, "Connection closed by peer" or "reset by peer", once the sender's
        process is gone)."""
        try:
            return step()
        except Exception as e:  # noqa: BLE001 - see above
            raise TransferError(
                f"weight sync: the {offer.nbytes}-byte buffer offered by trainer rank {offer.sender} did "
                f"not arrive whole over tpu_dist ({type(e).__name__}: {e})"
            ) from None

    def close(self) -> None:
        """Stop the group's gloo backend on this thread (gloo left running to interpreter exit can abort
        the process there: runtime/dist.py)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _key(channel: Channel) -> tuple[str, int, int, int]:
    return (channel.host, channel.port, channel.generation, channel.engine)


def joined(channel: Channel, rank: int) -> bool:
    """Whether this process is in `channel`'s group already (as `rank`)."""
    group = local().groups.get(_key(channel))
    return group is not None and group.rank == rank


def member(channel: Channel, rank: int) -> SyncGroup:
    """This process's member of `channel`'s group as `rank` (joined at the first call: blocks until every
    rank of the group joined; kept in the process's `LocalSync`, closed when the process exits)."""
    key, groups = _key(channel), local().groups
    if key not in groups:
        for old in [k for k in groups if k[:2] == key[:2] and k[2:] < key[2:]]:
            groups.pop(old).close()  # a lost trainer attempt's or rollout engine's group
        groups[key] = SyncGroup(channel, rank)
    return groups[key]
