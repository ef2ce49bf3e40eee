"""Per-worker state: the TrainContext behind get_context(), report() and get_checkpoint().

One `_Session` exists per worker process while a training function runs. `report()` is cheap: rank 0
keeps the metrics, every rank uploads its checkpoint files (if any) to
`<run_path>/checkpoint_<index>`, and the driver drains the queue with `drain()` while training runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tpuray.train.checkpoint import Checkpoint, checkpoint_dir, upload


@dataclass
class StorageInfo:
    storage_path: str
    experiment_name: str
    run_path: str


@dataclass
class TrainContext:
    """What a worker knows about its place in the run (mirrors ray.train.get_context())."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    storage_path: str
    run_path: str
    device_type: str = "cpu"  # "tpu", "cuda" or "cpu"
    emulated: bool = False
    attempt: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_trial_name(self) -> str:
        return self.experiment_name

    def get_trial_dir(self) -> str:
        return self.run_path

    def get_storage(self) -> StorageInfo:
        return StorageInfo(self.storage_path, self.experiment_name, self.run_path)

    def get_metadata(self) -> dict[str, Any]:
        return dict(self.metadata)

    def get_attempt(self) -> int:
        """0 for the first run, then +1 per restart after a worker/host failure."""
        return self.attempt


@dataclass
class ReportRecord:
    index: int
    metrics: dict[str, Any] | None  # rank 0 only
    has_checkpoint: bool


class _Session:
    def __init__(self, context: TrainContext, checkpoint: Checkpoint | None, first_index: int) -> None:
        self.context = context
        self.checkpoint = checkpoint
        self.next_index = first_index
        self._records: list[ReportRecord] = []
        self._lock = threading.Lock()

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None) -> None:
        if not isinstance(metrics, dict):
            raise TypeError(f"tpuray.train.report(metrics={metrics!r}): metrics must be a dict")
        index = self.next_index
        self.next_index += 1
        if checkpoint is not None:
            src = getattr(checkpoint, "path", None)
            if src is None:
                raise TypeError(
                    f"tpuray.train.report(checkpoint={checkpoint!r}): use tpuray.train.Checkpoint.from_directory(dir)"
                )
            upload(str(src), checkpoint_dir(self.context.run_path, index))
        keep = dict(metrics) if self.context.world_rank == 0 else None
        with self._lock:
            self._records.append(ReportRecord(index, keep, checkpoint is not None))

    def drain(self) -> list[ReportRecord]:
        with self._lock:
            records, self._records = self._records, []
        return records


_SESSION: _Session | None = None


def _start(context: TrainContext, checkpoint: Checkpoint | None, first_index: int) -> _Session:
    global _SESSION
    _SESSION = _Session(context, checkpoint, first_index)
    return _SESSION


def _current() -> _Session | None:
    return _SESSION


def _require(what: str) -> _Session:
    if _SESSION is None:
        raise RuntimeError(
            f"tpuray.train.{what}() only works inside train_loop_per_worker run by "
            "tpuray.train.torch.TorchTrainer.fit()"
        )
    return _SESSION


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
    """Report metrics (kept from rank 0) and optionally a checkpoint directory (persisted from every rank
    that passes one, merged into one checkpoint_<index> directory). Call it the same number of times on
    every rank."""
    _require("report").report(metrics, checkpoint)


def get_context() -> TrainContext:
    return _require("get_context").context


def get_checkpoint() -> Checkpoint | None:
    """The latest committed checkpoint when this run was restored after a failure, else None."""
    return _require("get_checkpoint").checkpoint
