"""Training workers: `TrainWorker` (the per-chip actor) and the worker-group spec a ScalingConfig asks for.

Reservation, ranks, process env, the process group and teardown come from
`tpuray.slices.SliceWorkerGroup`; this module adds what a training worker does: start the report session,
run the training function while the driver drains its reports.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpuray.constants import DEFAULT_UPLOAD_TIMEOUT_S, RESERVE_TIMEOUT_ENV, UPLOAD_TIMEOUT_ENV
from tpuray.slices.inventory import holder_name
from tpuray.slices.worker import SliceWorker
from tpuray.slices.worker_group import WorkerGroupSpec
from tpuray.train import session
from tpuray.train.checkpoint import Checkpoint
from tpuray.train.checkpoint.uploads import CheckpointUploadMode
from tpuray.train.config import ScalingConfig
from tpuray.train.session import TrainContext
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.train.data import WorkerShards

DEFAULT_RESERVE_TIMEOUT_S = 300.0


def _seconds_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):  # also refuses nan: every wait has a bound
        raise ConfigError(
            f"${name}={raw!r} is invalid: use a finite number of seconds > 0 (unset: {default:g})"
        )
    return value


def reserve_timeout_s() -> float:
    """How long a training attempt waits for its slice(s) and workers ($TPURAY_TRAIN_RESERVE_TIMEOUT_S):
    after a preemption, how long fit() waits for a spare slice or the preempted one's replacement."""
    return _seconds_env(RESERVE_TIMEOUT_ENV, DEFAULT_RESERVE_TIMEOUT_S)


def upload_timeout_s() -> float:
    """The longest wait for one checkpoint upload ($TPURAY_TRAIN_UPLOAD_TIMEOUT_S), read on the driver."""
    return _seconds_env(UPLOAD_TIMEOUT_ENV, DEFAULT_UPLOAD_TIMEOUT_S)


def group_spec(scaling: ScalingConfig, run_name: str = "") -> WorkerGroupSpec:
    """The worker group a ScalingConfig describes (TPU workers take no CPU unless asked), held in the
    name of the run `run_name`."""
    name = holder_name("train", run_name)
    res = scaling.worker_resources()
    num_cpus = res.pop("CPU", 0)
    num_gpus = res.pop("GPU", 0)
    if scaling.use_tpu:
        chips = int(res.pop("TPU"))
        return WorkerGroupSpec(
            num_workers=scaling.num_workers,
            topology=scaling.slice_topology,
            num_slices=scaling.num_slices or 1,
            chips_per_worker=chips,
            num_cpus=num_cpus,
            resources=res,
            reserve_timeout_s=reserve_timeout_s(),
            max_concurrency=2,
            name=name,
        )
    return WorkerGroupSpec(
        num_workers=scaling.num_workers,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=res,
        placement_strategy=scaling.placement_strategy,
        reserve_timeout_s=reserve_timeout_s(),
        max_concurrency=2,
        name=name,
    )


@dataclass
class WorkerOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""


class TrainWorker(SliceWorker):
    """Runs the training function in one process (`run`) while the driver drains reports (`drain`)."""

    def __init__(self) -> None:
        import torch  # noqa: F401  (warm the import while the other workers start)

    def start_session(
        self,
        context: TrainContext,
        checkpoint: Checkpoint | None,
        first_index: int,
        upload_mode: Any = None,
        shards: WorkerShards | None = None,
        upload_timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S,
    ) -> None:
        """upload_mode: CheckpointConfig.checkpoint_upload_mode; shards: this rank's
        tpuray.train.data.WorkerShards (TorchTrainer(datasets=...)) or None; upload_timeout_s: the
        driver's $TPURAY_TRAIN_UPLOAD_TIMEOUT_S."""
        iterators = shards.install() if shards is not None else None
        mode = upload_mode or CheckpointUploadMode.ASYNC
        session.start_session(context, checkpoint, first_index, mode, upload_timeout_s, iterators)

    def run(self, fn, config) -> WorkerOutcome:
        sess = session.require_session("run")
        rank = sess.context.world_rank
        try:
            value = fn(config) if config is not None else _call_maybe_without_config(fn)
            sess.uploads.finish()  # the last checkpoint's upload ends (or fails) before the run does
            return WorkerOutcome(rank, True, value=value)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the driver with its traceback
            return WorkerOutcome(rank, False, error=_picklable(exc), traceback=traceback.format_exc())
        finally:
            sess.uploads.close()  # after an error: let an upload in flight end, so it can still commit
            try:
                self.teardown_distributed()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                pass

    def notify_preemption(self, info) -> int:
        """The driver saw a drain of this run's slice: get_preemption_info() and should_checkpoint() say so.
        Returns the reports made so far (some may still be uploading), -1 before the session starts."""
        sess = session.current_session()
        return sess.notify_preemption(info) if sess is not None else -1

    def drain(self) -> list:
        sess = session.current_session()
        return sess.drain() if sess is not None else []


def _call_maybe_without_config(fn):
    import inspect

    try:
        n_params = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n_params = 1
    return fn() if n_params == 0 else fn({})


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
