"""The update message of a weight sync from a `tpuray.train` run (`TrainerUpdate`: what the driver hands
the rollout engine) and how a rollout rank gets its pieces of it (`resolve_pieces`: from the object
store, over the tpu_dist group, or from the colocated hand-over in its process)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpuray.rl.sync import handover
from tpuray.rl.sync.collective import Channel, member
from tpuray.rl.weights.layout import Piece


class SyncError(RuntimeError):
    """The other side of a weight sync went away (the trainer run or the driver ended)."""


@dataclass(frozen=True)
class TrainerUpdate:
    """A weight update sent by the ranks of a trainer: `refs[r]` are what rollout rank r receives from
    each trainer rank that holds some of its part: the ObjectRefs of the pieces (weight_sync
    "object_store"), or `Offer`s (trainer rank, the pieces' metadata, bytes) whose data comes over
    `channel`'s process group ("tpu_dist", `tpuray.rl.sync.collective`). Pass it to
    `RolloutEngine.update_weights`."""

    refs: tuple[tuple[Any, ...], ...]
    nbytes: tuple[int, ...]  # bytes each rollout rank receives
    channel: Channel | None = None  # tpu_dist: where the group meets; None: through the object store
    version: int = 0  # the weight version the trainer sent
    attempt: int = 0  # the tpuray.train attempt whose ranks sent it (0, then +1 per trainer restart)

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.refs)


def resolve_pieces(refs: Any, channel: Channel | None = None, rank: int = 0) -> list[dict[str, Piece]]:
    """The pieces addressed to rollout rank `rank`: pulled from the object store, or received over the
    tpu_dist group (`channel`) from the trainer ranks that offered them."""
    import ray

    if handover.is_handed(refs):  # colocated over tpu_dist: left in this process by its trainer rank
        return [handover.take(list(refs))]
    if channel is None:
        return list(ray.get([r for r in refs if r is not None]))
    return member(channel, channel.rollout_rank(rank)).recv_all(list(refs))
