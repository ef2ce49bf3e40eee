"""The driver loop behind TorchTrainer.fit(): one attempt after another (`tpuray.train.attempt`: reserve
-> start workers -> set up torch.distributed -> run -> collect reports -> tear down), restarting from the
latest committed checkpoint after worker/host failures and preemptions (checkpoint bookkeeping:
`tpuray.train.checkpoint.manager`; callbacks: `tpuray.train.callbacks.hooks`).

A lost slice ends the attempt instead of hanging it (every wait of an attempt is bounded): reservation
and worker start within $TPURAY_TRAIN_RESERVE_TIMEOUT_S (SliceReservationTimeout when no slice frees up:
fit() fails with NoSliceError), a checkpoint upload within $TPURAY_TRAIN_UPLOAD_TIMEOUT_S. A timed-out
wait is a worker failure (retried per FailureConfig(max_failures)); a worker lost with a host Ray drained
for preemption is a preemption (FailureConfig(max_preemption_failures)).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

from tpuray.constants import RESERVE_TIMEOUT_ENV
from tpuray.slices.placement import SliceReservationTimeout
from tpuray.train import checkpoint as ckpt
from tpuray.train.attempt import Attempt, AttemptPlan, Preempted, WorkerDied
from tpuray.train.callbacks import RunInfo
from tpuray.train.callbacks.hooks import RunHooks
from tpuray.train.callbacks.progress import Progress
from tpuray.train.checkpoint.manager import CheckpointManager, RunState
from tpuray.train.config import RunConfig, ScalingConfig, TorchConfig
from tpuray.train.data import DataConfig, TrainDatasets
from tpuray.train.result import Result, TrainingFailedError, WorkerGroupError
from tpuray.train.session import ReportRecord
from tpuray.train.worker import upload_timeout_s

logger = logging.getLogger("tpuray.train")


class NoSliceError(SliceReservationTimeout):
    """fit() found no free slice for an attempt within $TPURAY_TRAIN_RESERVE_TIMEOUT_S (e.g. after a
    preemption, no spare slice and no replacement). `result` holds what the run reached (its checkpoint)."""

    result: Result | None = None


class DataParallelTrainer:
    def __init__(
        self,
        train_loop_per_worker: Callable,
        *,
        train_loop_config: dict | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        torch_config: TorchConfig | None = None,
        resume_from_checkpoint: ckpt.Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
        datasets: dict | None = None,
        dataset_config: DataConfig | None = None,
    ) -> None:
        # Ray Data ingestion (tpuray.train.data): validated here, split per attempt.
        self._datasets = (
            TrainDatasets(datasets, dataset_config)
            if datasets is not None or dataset_config is not None
            else None
        )
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise TypeError(f"train_loop_config={train_loop_config!r} must be a dict or None")
        if not callable(train_loop_per_worker):
            raise TypeError(f"train_loop_per_worker={train_loop_per_worker!r} must be callable")
        if scaling_config is not None and not isinstance(scaling_config, ScalingConfig):
            raise TypeError(
                f"scaling_config={scaling_config!r} must be a tpuray.train.ScalingConfig "
                "(import it from tpuray.train, not ray.train)"
            )
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise TypeError(f"run_config={run_config!r} must be a tpuray.train.RunConfig")
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.torch_config = torch_config or TorchConfig()
        self.resume_from_checkpoint = resume_from_checkpoint
        self.metadata = dict(metadata or {})
        rc = self.run_config
        assert rc.name is not None and rc.storage_path is not None  # filled in by RunConfig.__post_init__
        self.name: str = rc.name
        self.storage_path: str = rc.storage_path
        self.run_path = ckpt.join(rc.storage_path, rc.name)
        # The run's state, made anew by every fit().
        self._hooks = RunHooks(rc.callbacks or [], self.run_path)
        self._checkpoints = CheckpointManager(rc.checkpoint_config, self.run_path)
        self._state: RunState | None = None  # once fit() has read run_state.json
        self._failures = 0  # restarts after worker/host failures
        self._preemptions = 0  # restarts after preemptions
        self._fn_ref: ray.ObjectRef | None = None  # train_loop_per_worker in the object store

    # ------------------------------------------------------------------------------------------
    def fit(self) -> Result:
        """Run training; RunConfig.callbacks see its start, reports, checkpoints, restarts and end."""
        rc = self.run_config
        self._hooks = hooks = RunHooks(rc.callbacks or [], self.run_path)
        self._checkpoints = CheckpointManager(rc.checkpoint_config, self.run_path)
        self._state = None
        self._failures = self._preemptions = 0
        try:
            sc = self.scaling_config
            hooks.start(RunInfo(self.name, self.storage_path, self.run_path, sc, self.train_loop_config))
            result = self._fit()
        except BaseException as exc:
            partial = getattr(exc, "result", None)
            if partial is None and self._state is not None:
                partial = self._result(exc, None)
            hooks.failed(exc, partial)
            raise
        return hooks.end(result)

    def _fit(self) -> Result:
        if not ray.is_initialized():
            ray.init()
        ckpt.ensure_dir(self.run_path)
        state = RunState(self.scaling_config.num_workers)
        if state.load(self.run_path):  # same run name as an earlier run: resume it (as Ray Train does)
            logger.warning(
                "tpuray.train: resuming run %s from checkpoint_%06d", self.run_path, state.latest_ckpt
            )
        self._checkpoints.restore(state)
        self._state = state
        plan = self._plan()
        progress = Progress(self._title(), self.run_config.quiet)
        try:
            while True:
                attempt = self._next_attempt(plan, state, progress)
                try:
                    value = attempt.run(self._train_fn(), self.train_loop_config)
                    state.save(self.run_path, finished=True)
                    return self._result(None, value)
                except SliceReservationTimeout as exc:
                    raise self._no_slice(attempt, exc) from exc
                except TrainingFailedError as err:
                    if err.result is None:
                        err.result = self._result(err, None)
                    raise
                except WorkerDied as died:
                    self._count_restart(progress, died, "failure")
                except Preempted as preempted:
                    self._count_restart(progress, preempted, "preemption")
                finally:
                    progress.close()
        finally:
            progress.close()

    def _plan(self) -> AttemptPlan:
        rc = self.run_config
        return AttemptPlan(
            scaling=self.scaling_config,
            backend=self.torch_config.backend or self.scaling_config.backend,
            setup_timeout_s=self.torch_config.timeout_s,
            upload_mode=rc.checkpoint_config.checkpoint_upload_mode,
            upload_timeout_s=upload_timeout_s(),  # read here, handed to every worker
            datasets=self._datasets,
            name=self.name,
            storage_path=self.storage_path,
            run_path=self.run_path,
            metadata=self.metadata,
        )

    def _next_attempt(self, plan: AttemptPlan, state: RunState, progress: Progress) -> Attempt:
        """The next attempt, resuming right after the latest committed checkpoint (or from
        resume_from_checkpoint at first); the checkpoint directories past it are deleted."""
        resume = state.rewind()
        restored: ckpt.Checkpoint | None
        if resume:
            restored = ckpt.Checkpoint(ckpt.checkpoint_dir(self.run_path, resume - 1))
        else:
            restored = self.resume_from_checkpoint
        self._checkpoints.drop_from(resume)
        number = self._failures + self._preemptions

        def on_records(per_rank: list[tuple[int, list[ReportRecord]]]) -> None:
            self._record(state, per_rank, progress)

        return Attempt(plan, number, restored, state, progress, on_records)

    def _record(
        self, state: RunState, per_rank: list[tuple[int, list[ReportRecord]]], progress: Progress
    ) -> None:
        """Book the records an attempt drained: callbacks see the reports every rank made; a newly
        committed checkpoint prunes the kept set and is persisted to run_state.json."""
        for rank, records in per_rank:
            state.add(rank, records, progress.update)
        committed = state.commit()
        self._hooks.after_collect(state, self._checkpoints.register)  # registers committed checkpoints
        self._checkpoints.sync(state)
        if committed is not None:
            self._checkpoints.prune(state)  # keep the latest or best CheckpointConfig.num_to_keep
            state.save(self.run_path)

    def _train_fn(self) -> ray.ObjectRef:
        if self._fn_ref is None:
            self._fn_ref = ray.put(self.train_loop_per_worker)
        return self._fn_ref

    def _count_restart(self, progress: Progress, why: Exception, kind: str) -> None:
        """Count a restart against its limit (raise past it) and say where the run resumes from."""
        fc = self.run_config.failure_config
        if kind == "preemption":
            self._preemptions += 1
            count, limit, knob = self._preemptions, fc.max_preemption_failures, "max_preemption_failures"
        else:
            self._failures += 1
            count, limit, knob = self._failures, fc.max_failures, "max_failures"
        if limit != -1 and count > limit:
            rank = getattr(why, "rank", None)
            cause = getattr(why, "cause", why)
            err = WorkerGroupError(
                f"Training failed: {why} ({kind} {count}, FailureConfig({knob}={limit}))",
                {rank if rank is not None else -1: cause},
            )
            err.result = self._result(err, None)
            raise err from cause
        latest = self._run_state().latest_ckpt
        where = f"checkpoint_{latest:06d}" if latest is not None else "scratch"
        progress.note(
            f"tpuray.train: {why}; releasing the reservation and restarting all workers from {where} "
            f"({kind} {count}/{'inf' if limit == -1 else limit})"
        )
        self._hooks.restart(self._failures + self._preemptions, why)

    def _title(self) -> str:
        sc = self.scaling_config
        topo = sc.slice_topology
        if topo is not None:
            where = f"{sc.num_slices}x {topo.generation.name} {topo.topology}"
        else:
            where = "GPU" if sc.use_gpu else "CPU"
        return f"tpuray.train {self.name} [{sc.num_workers} workers, {where}]"

    def _no_slice(self, attempt: Attempt, exc: SliceReservationTimeout) -> NoSliceError:
        """The reservation timed out: say what the run had reached and where it can resume from."""
        after = (
            f" after {self._preemptions} preemption(s) and {self._failures} failure(s) (a preempted slice "
            "comes back only when its node pool replaces it)"
            if attempt.number
            else ""
        )
        latest = self._run_state().latest_ckpt
        where = (
            f"; its latest checkpoint (checkpoint_{latest:06d}, Result.checkpoint) is kept: fit() "
            "with the same RunConfig(name=...) resumes from it"
            if latest is not None
            else ""
        )
        err = NoSliceError(
            f"Training failed: attempt {attempt.number}{after} found no free slice within "
            f"{attempt.group.spec.reserve_timeout_s}s (${RESERVE_TIMEOUT_ENV}){where}. {exc}"
        )
        err.result = self._result(err, None)
        return err

    def _run_state(self) -> RunState:
        assert self._state is not None, "fit() reads the run state first"
        return self._state

    def _result(self, error: BaseException | None, value: Any) -> Result:
        state = self._run_state()
        latest = state.latest_ckpt
        history = state.metrics_history()
        return Result(
            metrics=history[-1] if history else None,
            checkpoint=ckpt.Checkpoint(ckpt.checkpoint_dir(self.run_path, latest))
            if latest is not None
            else None,
            error=error,
            path=self.run_path,
            metrics_history=history,
            return_value=value,
            num_failures=self._failures,
            num_preemptions=self._preemptions,
            best_checkpoints=self._checkpoints.best_checkpoints(),
        )
