"""What an `RLRun` returns (`RLResult`, with per-iteration `IterationStats`) or raises (`RLRunError`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RLRunError(RuntimeError):
    """The RL run ended because one side failed (the trainer run, the rollout engine or a weight sync);
    the cause is chained. Everything the run reserved was released."""


@dataclass(frozen=True)
class IterationStats:
    """One iteration on the driver: seconds in `rollout` (rollout_fn of the next batch: generate + reward;
    with overlap, while the trainer trains), `wait` (for the trainer's weights, beyond the rollout),
    `sync` (update_weights: transfer + load; after a trainer restart, with the versions it re-sent; 0
    where the engine that replaced a failed one took the update during the rollout, counted there) and
    `total`; `sync_bytes` the rollout ranks received, each from up to `senders` trainer ranks; `freed`
    (colocated) what the engine released on the chips for training."""

    rollout: float
    wait: float
    sync: float
    total: float
    sync_bytes: int
    senders: int
    freed: int = 0  # colocated: bytes the engine's sleep() freed on the chips before the trainer trained
    batches_held: int = 0  # batches kept for a trainer restart (those read since the last checkpoint)


@dataclass
class RLResult:
    """What `RLRun.run` returns: the trainer's `tpuray.train.Result`, each iteration's batch as
    rollout_fn returned it (its time split in `times`)."""

    train_result: Any
    batches: list[Any]
    times: list[IterationStats]
    rollout_restarts: int = 0
    """Rollout engines replaced after a failure (RLConfig.rollout_max_failures)."""
    versions: list[int] = field(default_factory=list)
    """The weight versions the engine loaded, in order: 1..iterations, plus, after a trainer restart, the
    versions after its checkpoint again (the restarted trainer's state replaces the lost one's)."""
