"""Per-worker state: the TrainContext behind get_context(), report(), get_checkpoint() and
get_dataset_shard().

One `WorkerSession` exists per worker process while a training function runs (`start_session()`; the
worker's only module-level state): its context, the checkpoint it resumes from, its dataset shards, the
preemption notice and its upload queue. `report()` is cheap: rank 0
keeps the metrics, every rank uploads its checkpoint files (if any) to
`<run_path>/checkpoint_<index>` (in the background by default: `tpuray.train.checkpoint.uploads`), and the driver
drains the queue with `drain()` while training runs; a report's record is drained only once its
checkpoint files are all uploaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpuray.constants import DEFAULT_UPLOAD_TIMEOUT_S
from tpuray.slices.drain import PreemptionInfo
from tpuray.train.checkpoint import Checkpoint, checkpoint_dir
from tpuray.train.checkpoint.uploads import CheckpointUploadMode, UploadQueue, parse_upload_mode

if TYPE_CHECKING:
    from ray.data import DataIterator


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
        """0 for the first run, then +1 per restart after a worker/host failure or a preemption."""
        return self.attempt

    def should_checkpoint(self) -> bool:
        """True once the slice is being preempted and until this worker reports a checkpoint: the driver
        ends the attempt as soon as that checkpoint is committed, and resumes from it on another slice."""
        session = current_session()
        return session is not None and session.checkpoint_requested


@dataclass
class ReportRecord:
    index: int
    metrics: dict[str, Any] | None  # rank 0 only
    has_checkpoint: bool


class WorkerSession:
    """One worker's state while its training function runs."""

    def __init__(
        self,
        context: TrainContext,
        checkpoint: Checkpoint | None,
        first_index: int,
        upload_mode: CheckpointUploadMode = CheckpointUploadMode.ASYNC,
        upload_timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S,
        shards: dict[str, DataIterator] | None = None,
    ) -> None:
        self.context = context
        self.checkpoint = checkpoint
        self.next_index = first_index
        self.upload_mode = upload_mode
        self.uploads = UploadQueue(upload_timeout_s)
        self.shards: dict[str, DataIterator] = dict(shards or {})  # TorchTrainer(datasets=...), by name
        self.preemption: PreemptionInfo | None = None  # set by the driver on a preemption notice
        self.checkpoint_requested = False

    def dataset_shard(self, name: str | None) -> DataIterator:
        """This worker's iterator of dataset `name` (None: the only dataset)."""
        shards = self.shards
        if name is None:
            if len(shards) == 1:
                return next(iter(shards.values()))
            raise KeyError(
                f"get_dataset_shard() needs a dataset name when there is not exactly one dataset; "
                f"this run has {sorted(shards)!r}"
            )
        if name not in shards:
            raise KeyError(
                f"get_dataset_shard({name!r}): no such dataset; pass it in TorchTrainer(datasets=...) "
                f"(this run has {sorted(shards)!r})"
            )
        return shards[name]

    def notify_preemption(self, info: PreemptionInfo) -> int:
        """Record the notice; return how many reports this worker has made (uploaded or not)."""
        if self.preemption is None:
            self.checkpoint_requested = True
        self.preemption = info
        return self.next_index

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None, upload_mode: Any = None) -> None:
        if not isinstance(metrics, dict):
            raise TypeError(f"tpuray.train.report(metrics={metrics!r}): metrics must be a dict")
        mode = (
            self.upload_mode
            if upload_mode is None
            else parse_upload_mode(upload_mode, "tpuray.train.report(checkpoint_upload_mode)")
        )
        src = None
        if checkpoint is not None:
            src = getattr(checkpoint, "path", None)
            if src is None:
                raise TypeError(
                    f"tpuray.train.report(checkpoint={checkpoint!r}): use tpuray.train.Checkpoint.from_directory(dir)"
                )
        index = self.next_index
        self.next_index += 1
        keep = dict(metrics) if self.context.world_rank == 0 else None
        record = ReportRecord(index, keep, checkpoint is not None)
        dest = checkpoint_dir(self.context.run_path, index)
        self.uploads.add(record, None if src is None else str(src), dest, mode)
        if checkpoint is not None:
            self.checkpoint_requested = False

    def drain(self) -> list[ReportRecord]:
        return self.uploads.drain()


_SESSION: WorkerSession | None = None  # this worker process's session (one attempt's worker each)


def start_session(
    context: TrainContext,
    checkpoint: Checkpoint | None,
    first_index: int,
    upload_mode: CheckpointUploadMode = CheckpointUploadMode.ASYNC,
    upload_timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S,
    shards: dict[str, DataIterator] | None = None,
) -> WorkerSession:
    global _SESSION
    _SESSION = WorkerSession(context, checkpoint, first_index, upload_mode, upload_timeout_s, shards)
    return _SESSION


def current_session() -> WorkerSession | None:
    return _SESSION


def require_session(what: str) -> WorkerSession:
    """The running session, else RuntimeError naming `tpuray.train.<what>()`."""
    if _SESSION is None:
        raise RuntimeError(
            f"tpuray.train.{what}() only works inside train_loop_per_worker run by "
            "tpuray.train.torch.TorchTrainer.fit()"
        )
    return _SESSION


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_upload_mode: CheckpointUploadMode | str | None = None,
) -> None:
    """Report metrics (kept from rank 0) and optionally a checkpoint directory (persisted from every rank
    that passes one, merged into one checkpoint_<index> directory). Call it the same number of times on
    every rank.

    checkpoint_upload_mode: None = CheckpointConfig.checkpoint_upload_mode (default ASYNC), or
    CheckpointUploadMode.ASYNC / SYNC ("async" / "sync"; Ray's CheckpointUploadMode works too).
    ASYNC returns before the upload ends: the files are hard-linked into a snapshot, so the directory may
    be deleted (or its files replaced by new ones) as soon as report() returns, but its existing files
    must not be written in place until the next report() returns (tpuray detects it and fails the run
    with CheckpointUploadError naming the file). Upload errors are raised by the next report() or when
    the training function returns. SYNC: the files are in storage when report() returns. Either way the
    checkpoint is committed only once every rank's files are uploaded (see tpuray.train.checkpoint.uploads)."""
    require_session("report").report(metrics, checkpoint, checkpoint_upload_mode)


def get_context() -> TrainContext:
    return require_session("get_context").context


def get_preemption_info() -> PreemptionInfo | None:
    """The pending preemption of this run's slice(s) (deadline, preempted node -> ranks), else None.

    When it is set, report a checkpoint soon (`get_context().should_checkpoint()` says so): the run then
    resumes from it on another slice, and no step before the notice is lost."""
    return require_session("get_preemption_info").preemption


def get_checkpoint() -> Checkpoint | None:
    """The latest committed checkpoint when this run was restored after a failure, else None."""
    return require_session("get_checkpoint").checkpoint
