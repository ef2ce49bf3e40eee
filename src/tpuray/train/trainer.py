"""The driver loop behind TorchTrainer.fit(): reserve -> start workers -> set up torch.distributed -> run
-> collect reports -> tear down, restarting from the latest committed checkpoint after worker/host
failures (report and checkpoint bookkeeping: `tpuray.train.run_state`).

Every wait is bounded, so a slice lost at any point (reservation, worker start, process-group set-up,
training) ends the attempt instead of hanging it: reservation and worker start within
$TPURAY_TRAIN_RESERVE_TIMEOUT_S (SliceReservationTimeout when no slice frees up: fit() fails with it),
process-group set-up within TorchConfig.timeout_s (+ WORKER_CALL_TIMEOUT_S), the calls a live worker
answers at once within WORKER_CALL_TIMEOUT_S, a checkpoint upload within $TPURAY_TRAIN_UPLOAD_TIMEOUT_S.
A timed-out wait is a worker failure (retried per FailureConfig(max_failures)); a worker lost with a
host Ray drained for preemption is a preemption (FailureConfig(max_preemption_failures)).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from tpuray.constants import (
    DEADLINE_MARGIN_S,
    PREEMPTION_NOTIFY_TIMEOUT_S,
    RESERVE_TIMEOUT_ENV,
    WORKER_CALL_TIMEOUT_S,
)
from tpuray.slices.distributed import RankInfo, device_type_for
from tpuray.slices.drain import DrainWatch, PreemptionInfo, describe, failure_domains
from tpuray.slices.placement import SliceReservationTimeout
from tpuray.slices.worker_group import SliceWorkerGroup
from tpuray.train import checkpoint as ckpt
from tpuray.train.callbacks import RunHooks, RunInfo
from tpuray.train.config import RunConfig, ScalingConfig, TorchConfig
from tpuray.train.data import AttemptShards, DataConfig, TrainDatasets
from tpuray.train.group_start import start_group
from tpuray.train.progress import Progress
from tpuray.train.result import Result, WorkerGroupError
from tpuray.train.run_state import RunState
from tpuray.train.session import TrainContext
from tpuray.train.upload import CheckpointUploadTimeout
from tpuray.train.worker import TrainWorker, WorkerOutcome, group_spec, upload_timeout_s

logger = logging.getLogger("tpuray.train")
POLL_S = 0.2


class _Preempted(Exception):
    """The run's slice is being preempted: the attempt ends (after a checkpoint, or at the deadline).
    info is None when the hosts were gone (Ray: drained for preemption) before the notice was seen."""

    def __init__(self, info: PreemptionInfo | None, checkpointed: bool, how: str = "") -> None:
        if info is None:
            what = "its host(s) went (Ray had drained them for preemption) before the trainer saw a notice"
        else:
            what = describe(info)
        if not how:
            how = "after a checkpoint it asked for" if checkpointed else "without a new checkpoint"
        super().__init__(f"slice preempted: {what}; attempt ended {how}")
        self.info = info


class _WorkerDied(Exception):
    def __init__(self, rank: int | None, cause: BaseException) -> None:
        super().__init__(f"worker rank {rank} died: {cause}")
        self.rank = rank
        self.cause = cause

    @property
    def preempted(self) -> bool:
        """The worker went with a host Ray had drained for preemption (its node died as
        AUTOSCALER_DRAIN_PREEMPTED), whether or not the driver saw the notice."""
        cause = self.cause
        return isinstance(cause, ray.exceptions.RayActorError) and bool(getattr(cause, "preempted", False))


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

    # ------------------------------------------------------------------------------------------
    def fit(self) -> Result:
        """Run training; RunConfig.callbacks see its start, reports, checkpoints, restarts and end."""
        rc = self.run_config
        self._hooks = hooks = RunHooks(rc.callbacks or [], rc.checkpoint_config, self.run_path)
        try:
            sc = self.scaling_config
            hooks.start(RunInfo(self.name, self.storage_path, self.run_path, sc, self.train_loop_config))
            result = self._fit()
        except BaseException as exc:
            partial = getattr(exc, "result", None)
            if partial is None and hooks.state is not None:
                partial = self._result(hooks.state, exc, None)
            hooks.failed(exc, partial)
            raise
        return hooks.end(result)

    def _fit(self) -> Result:
        if not ray.is_initialized():
            ray.init()
        sc, rc = self.scaling_config, self.run_config
        backend = self.torch_config.backend or sc.backend
        ckpt.ensure_dir(self.run_path)
        state = RunState(sc.num_workers)
        if state.load(self.run_path):  # same run name as an earlier run: resume it (as Ray Train does)
            logger.warning(
                "tpuray.train: resuming run %s from checkpoint_%06d", self.run_path, state.latest_ckpt
            )
        self._hooks.attach(state)
        self._failures = self._preemptions = 0
        self._upload_timeout_s = upload_timeout_s()  # read here, handed to every worker
        progress = Progress(self._title(), rc.quiet)
        try:
            while True:
                resume = state.rewind()
                restored: ckpt.Checkpoint | None
                if resume:
                    restored = ckpt.Checkpoint(ckpt.checkpoint_dir(self.run_path, resume - 1))
                else:
                    restored = self.resume_from_checkpoint
                self._drop_stale_checkpoints(resume)
                attempt = self._failures + self._preemptions
                try:
                    value = self._run_attempt(state, backend, restored, attempt, progress)
                    state.save(self.run_path, finished=True)
                    return self._result(state, None, value)
                except _WorkerDied as died:
                    self._count_restart(state, progress, died, "failure")
                except _Preempted as preempted:
                    self._count_restart(state, progress, preempted, "preemption")
                finally:
                    progress.close()
        finally:
            progress.close()

    def _count_restart(self, state: RunState, progress: Progress, why: Exception, kind: str) -> None:
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
            err.result = self._result(state, err, None)
            raise err from cause
        where = f"checkpoint_{state.latest_ckpt:06d}" if state.latest_ckpt is not None else "scratch"
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

    def _run_attempt(self, state: RunState, backend: str, restored, attempt: int, progress: Progress) -> Any:
        sc = self.scaling_config
        group = SliceWorkerGroup(group_spec(sc), TrainWorker)
        self._notice: tuple[PreemptionInfo, int] | None = None  # (notice, last report index before it)
        t0 = time.perf_counter()
        finished = False
        shards: AttemptShards | None = None
        try:
            try:  # reservation and worker start: bounded by the spec's reserve_timeout_s
                lost = start_group(group, POLL_S)  # aborted when a reserved host drains or dies
            except SliceReservationTimeout as exc:
                raise self._no_slice(state, group, attempt, exc) from exc
            except (ray.exceptions.RayActorError, TimeoutError) as exc:  # a host lost while workers start
                raise _WorkerDied(None, exc) from exc
            if lost is not None and lost.preempted:
                raise _Preempted(lost.info, checkpointed=False, how="while its workers started")
            if lost is not None:
                raise _WorkerDied(None, RuntimeError(str(lost)))
            self._watch = DrainWatch(
                failure_domains(
                    (m.placement.node_id, m.placement.slice_name, m.rank.world_rank) for m in group.members
                )
            )
            if group.emulated and sc.use_tpu and "emulated" not in progress.title:
                progress.title = progress.title + " (emulated TPU)"
            progress.start(attempt, len(state.history))
            if self._datasets is not None:  # a fresh split per attempt (coordinators die with it)
                shards = self._datasets.split([m.placement.node_id for m in group.members], sc.use_tpu)

            def context(rank: RankInfo) -> TrainContext:
                return TrainContext(
                    world_rank=rank.world_rank,
                    world_size=rank.world_size,
                    local_rank=rank.local_rank,
                    local_world_size=rank.local_world_size,
                    node_rank=rank.node_rank,
                    experiment_name=self.name,
                    storage_path=self.storage_path,
                    run_path=self.run_path,
                    device_type=device_type_for(backend),
                    emulated=group.emulated,
                    attempt=attempt,
                    metadata=self.metadata,
                )

            t1 = time.perf_counter()
            setup_refs = group.init_process_group(backend, self.torch_config.timeout_s)
            upload_mode = self.run_config.checkpoint_config.checkpoint_upload_mode
            setup_refs += group.call_each(
                "start_session",
                [
                    (
                        context(m.rank),
                        restored,
                        state.base,
                        upload_mode,
                        shards and shards.for_rank(i),
                        self._upload_timeout_s,
                    )
                    for i, m in enumerate(group.members)
                ],
            )
            # A rank stuck in set-up past the process group's own timeout is lost (its host unreachable).
            setup_s = self.torch_config.timeout_s + WORKER_CALL_TIMEOUT_S
            self._wait_all(group, setup_refs, state, progress, within_s=setup_s, what="process-group set-up")
            t2 = time.perf_counter()
            logger.info("tpuray.train: workers started in %.2fs, process group up in %.2fs", t1 - t0, t2 - t1)
            run_refs = group.call("run", self._fn_ref(), self.train_loop_config)
            outcomes = self._wait_all(group, run_refs, state, progress)
            self._collect(group, state, progress)
            finished = True
            return outcomes[0].value if outcomes else None
        except _WorkerDied as died:
            if self._notice is not None:  # the preempted host went before the attempt stopped
                raise _Preempted(
                    self._notice[0], False, how="when the host went, before a new checkpoint"
                ) from died
            if died.preempted:  # drained and gone before a notice was seen (e.g. while workers started)
                raise _Preempted(None, checkpointed=False) from died
            raise
        finally:
            group.shutdown(graceful=finished)
            if shards is not None:
                shards.shutdown()

    def _fn_ref(self):
        if not hasattr(self, "_fn_obj_ref"):
            self._fn_obj_ref = ray.put(self.train_loop_per_worker)
        return self._fn_obj_ref

    def _no_slice(
        self, state: RunState, group: SliceWorkerGroup, attempt: int, exc: SliceReservationTimeout
    ) -> NoSliceError:
        """The reservation timed out: say what the run had reached and where it can resume from."""
        after = (
            f" after {self._preemptions} preemption(s) and {self._failures} failure(s) (a preempted slice "
            "comes back only when its node pool replaces it)"
            if attempt
            else ""
        )
        where = (
            f"; its latest checkpoint (checkpoint_{state.latest_ckpt:06d}, Result.checkpoint) is kept: fit() "
            "with the same RunConfig(name=...) resumes from it"
            if state.latest_ckpt is not None
            else ""
        )
        err = NoSliceError(
            f"Training failed: attempt {attempt}{after} found no free slice within "
            f"{group.spec.reserve_timeout_s}s (${RESERVE_TIMEOUT_ENV}){where}. {exc}"
        )
        err.result = self._result(state, err, None)
        return err

    def _wait_all(
        self,
        group: SliceWorkerGroup,
        refs: list,
        state: RunState,
        progress: Progress,
        within_s: float | None = None,
        what: str = "",
    ) -> list:
        """Wait for calls on the workers (refs in rank order, possibly several rounds) while draining
        reports; raise on the first failure. With `within_s`, ranks still busy after it are lost
        (_WorkerDied: a worker failure)."""
        index_of = {ref: i for i, ref in enumerate(refs)}
        outcomes: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = None if within_s is None else time.monotonic() + within_s
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                ranks = sorted({index_of[ref] % group.world_size for ref in pending})
                raise _WorkerDied(
                    ranks[0],
                    TimeoutError(f"{what} on rank(s) {ranks} did not finish within {within_s:g}s"),
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in ready:
                index = index_of[ref]
                rank = index % group.world_size
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise _WorkerDied(rank, exc) from exc
                except ray.exceptions.RayTaskError as exc:  # set-up failed (e.g. process group init)
                    self._collect_quietly(group, state, progress)
                    self._check_peers_alive(group, rank, exc)
                    self._raise_user_error(state, {rank: exc.as_instanceof_cause()}, {rank: str(exc)})
                if isinstance(out, WorkerOutcome) and not out.ok:
                    self._collect_quietly(group, state, progress)
                    if isinstance(out.error, CheckpointUploadTimeout):  # storage gone: retried, not fatal
                        raise _WorkerDied(rank, out.error)
                    self._check_peers_alive(group, rank, out.error)
                    self._raise_user_error(state, {rank: out.error}, {rank: out.traceback})
                outcomes[index] = out
            self._collect(group, state, progress)
            if pending:
                self._check_preemption(group, state, progress)
        return outcomes

    def _check_preemption(self, group: SliceWorkerGroup, state: RunState, progress: Progress) -> None:
        """On a drain of the run's hosts: tell every worker (get_preemption_info(), should_checkpoint()),
        then end the attempt once no report made before the notice can be lost (the newest committed
        checkpoint covers it) or when the deadline is DEADLINE_MARGIN_S away."""
        info = self._watch.poll()
        if info is None:
            return
        if self._notice is None or self._notice[0] != info:
            first = self._notice is None
            # The loop reads the notice between steps; each worker answers with the reports it has made
            # (the driver sees a report only once its checkpoint is uploaded).
            try:
                made = ray.get(group.call("notify_preemption", info), timeout=PREEMPTION_NOTIFY_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                raise _Preempted(info, checkpointed=False) from exc
            last = max([*made, *state.counts]) - 1 if first else self._notice[1]  # type: ignore[index]
            self._notice = (info, last)
            if first:
                progress.note(
                    f"tpuray.train: preemption notice for {describe(info)}; asking for a checkpoint"
                )
        info, last = self._notice
        if last < state.base or (state.latest_ckpt is not None and state.latest_ckpt >= last):
            raise _Preempted(info, checkpointed=last >= state.base)
        left = info.seconds_left()
        if left is not None and left <= DEADLINE_MARGIN_S:
            raise _Preempted(info, checkpointed=False, how="at the deadline, without a new checkpoint")

    def _collect(self, group: SliceWorkerGroup, state: RunState, progress: Progress) -> None:
        refs = group.call("drain")
        try:
            per_rank = ray.get(refs, timeout=WORKER_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            raise _WorkerDied(None, exc) from exc
        except ray.exceptions.GetTimeoutError as exc:  # a worker that cannot answer at once is lost
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            silent = [rank for rank, ref in enumerate(refs) if ref not in ready]
            cause = TimeoutError(
                f"worker rank(s) {silent} did not hand over their reports within {WORKER_CALL_TIMEOUT_S:g}s "
                "(host lost or unresponsive)"
            )
            raise _WorkerDied(silent[0] if silent else None, cause) from exc
        for m, records in zip(group.members, per_rank, strict=True):
            state.add(m.rank.world_rank, records, progress.update)
        committed = state.commit()
        self._hooks.after_collect(state)  # callbacks; registers committed checkpoints for scoring
        if committed is not None:
            self._prune_checkpoints(state)
            state.save(self.run_path)

    def _collect_quietly(self, group: SliceWorkerGroup, state: RunState, progress: Progress) -> None:
        try:
            self._collect(group, state, progress)
        except _WorkerDied:
            pass

    def _check_peers_alive(self, group: SliceWorkerGroup, rank: int, error: BaseException | None) -> None:
        """A worker error can be the echo of a peer's death (gloo/tpu_dist "connection closed by peer"):
        ping every worker; if one is dead or unresponsive, it is a worker failure (retried), not a user
        error. Ray may need a while to declare a killed host dead, hence the generous timeout."""
        try:
            ray.get([m.actor.ping.remote() for m in group.members], timeout=WORKER_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise _WorkerDied(None, exc) from error

    def _raise_user_error(self, state: RunState, errors: dict, tracebacks: dict) -> None:
        lines = [f"Training failed: worker rank {r} raised:\n{tb}" for r, tb in tracebacks.items()]
        err = WorkerGroupError("\n".join(lines), errors)
        err.result = self._result(state, err, None)
        raise err

    def _result(self, state: RunState, error, value) -> Result:
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
            num_failures=getattr(self, "_failures", 0),
            num_preemptions=getattr(self, "_preemptions", 0),
            best_checkpoints=self._hooks.best_checkpoints() if hasattr(self, "_hooks") else [],
        )

    def _drop_stale_checkpoints(self, resume: int) -> None:
        for index in ckpt.list_checkpoints(self.run_path):
            if index >= resume:
                ckpt.delete(ckpt.checkpoint_dir(self.run_path, index))

    def _prune_checkpoints(self, state: RunState) -> None:
        """Keep the latest or best CheckpointConfig.num_to_keep (tpuray.train.checkpoint_manager)."""
        self._hooks.checkpoints.prune(state)
