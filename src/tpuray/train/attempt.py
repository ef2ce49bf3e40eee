"""One attempt of a training run: start the worker group, set up torch.distributed and the workers'
sessions, run the training function while draining reports and watching for a preemption, tear down.

An `Attempt` owns its worker group, the drain watch over the group's hosts, the preemption notice and
the wait loop. The run's bookkeeping stays with the trainer: every batch of drained report records goes
to the `on_records` callback it is given. How an attempt ends:

* it returns the training function's value (rank 0's) once every rank finished;
* `WorkerDied`: a worker or host was lost, or a wait timed out (a worker failure, retried);
* `Preempted`: a host of the run's slices was drained for preemption (the attempt ends once no report
  made before the notice can be lost, or at the deadline);
* `WorkerGroupError`: the training function (or set-up) raised on a worker (not retried);
* `SliceReservationTimeout`: no slice freed up within the reservation timeout.

Every wait is bounded: reservation and worker start within $TPURAY_TRAIN_RESERVE_TIMEOUT_S,
process-group set-up within TorchConfig.timeout_s (+ WORKER_CALL_TIMEOUT_S), the calls a live worker
answers at once within WORKER_CALL_TIMEOUT_S.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from tpuray.constants import DEADLINE_MARGIN_S, PREEMPTION_NOTIFY_TIMEOUT_S, WORKER_CALL_TIMEOUT_S
from tpuray.slices.distributed import RankInfo, device_type_for
from tpuray.slices.drain import DrainWatch, PreemptionInfo, describe, failure_domains
from tpuray.slices.group_start import start_group
from tpuray.slices.placement import SliceReservationTimeout
from tpuray.slices.worker_group import SliceWorkerGroup
from tpuray.train.callbacks.progress import Progress
from tpuray.train.checkpoint import Checkpoint
from tpuray.train.checkpoint.manager import RunState
from tpuray.train.checkpoint.uploads import CheckpointUploadMode, CheckpointUploadTimeout
from tpuray.train.data import AttemptShards, TrainDatasets
from tpuray.train.result import WorkerGroupError
from tpuray.train.scaling import ScalingConfig
from tpuray.train.session import ReportRecord, TrainContext
from tpuray.train.worker import TrainWorker, WorkerOutcome, group_spec

logger = logging.getLogger("tpuray.train")
POLL_S = 0.2


# (world rank, records it handed over) for every rank, in rank order
OnRecords = Callable[[list[tuple[int, list[ReportRecord]]]], None]


class Preempted(Exception):
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


class WorkerDied(Exception):
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


@dataclass(frozen=True)
class AttemptPlan:
    """What every attempt of one fit() starts its workers with."""

    scaling: ScalingConfig
    backend: str
    setup_timeout_s: float  # TorchConfig.timeout_s
    upload_mode: CheckpointUploadMode | str  # CheckpointConfig.checkpoint_upload_mode
    upload_timeout_s: float  # $TPURAY_TRAIN_UPLOAD_TIMEOUT_S, read on the driver
    datasets: TrainDatasets | None
    name: str
    storage_path: str
    run_path: str
    metadata: dict[str, Any] = field(default_factory=dict)


class Attempt:
    """start -> run the training function -> close; `run()` does all three (see the module doc)."""

    def __init__(
        self,
        plan: AttemptPlan,
        number: int,
        restored: Checkpoint | None,
        state: RunState,
        progress: Progress,
        on_records: OnRecords,
    ) -> None:
        self.plan = plan
        self.number = number  # 0, then +1 per restart
        self.restored = restored  # the checkpoint the workers resume from (get_checkpoint())
        self.state = state  # read here (report counts, latest checkpoint); written by on_records
        self.progress = progress
        self.on_records = on_records
        self.group = SliceWorkerGroup(group_spec(plan.scaling, plan.name), TrainWorker)
        self.watch: DrainWatch | None = None  # the group's hosts, once started
        self.notice: tuple[PreemptionInfo, int] | None = None  # (notice, last report index before it)
        self.shards: AttemptShards | None = None  # this attempt's split of the datasets

    def run(self, fn_ref: Any, config: dict | None) -> Any:
        """Start, run `fn_ref(config)` on every worker, return rank 0's value; always torn down."""
        finished = False
        try:
            self._start()
            outcomes = self._wait_all(self.group.call("run", fn_ref, config))
            self._collect()
            finished = True
            return outcomes[0].value if outcomes else None
        except WorkerDied as died:
            if self.notice is not None:  # the preempted host went before the attempt stopped
                raise Preempted(
                    self.notice[0], False, how="when the host went, before a new checkpoint"
                ) from died
            if died.preempted:  # drained and gone before a notice was seen (e.g. while workers started)
                raise Preempted(None, checkpointed=False) from died
            raise
        finally:
            self.close(graceful=finished)

    def close(self, graceful: bool) -> None:
        self.group.shutdown(graceful=graceful)
        if self.shards is not None:
            self.shards.shutdown()

    # -- start ----------------------------------------------------------------------------------
    def _start(self) -> None:
        plan = self.plan
        t0 = time.perf_counter()
        self._start_group()
        group = self.group
        self.watch = DrainWatch(
            failure_domains(
                (m.placement.node_id, m.placement.slice_name, m.rank.world_rank) for m in group.members
            )
        )
        if group.emulated and plan.scaling.use_tpu and "emulated" not in self.progress.title:
            self.progress.title = self.progress.title + " (emulated TPU)"
        self.progress.start(self.number, len(self.state.history))
        if plan.datasets is not None:  # a fresh split per attempt (coordinators die with it)
            self.shards = plan.datasets.split(
                [m.placement.node_id for m in group.members], plan.scaling.use_tpu
            )
        t1 = time.perf_counter()
        refs = group.init_process_group(plan.backend, plan.setup_timeout_s)
        refs += group.call_each("start_session", [self._session_args(i) for i in range(group.world_size)])
        # A rank stuck in set-up past the process group's own timeout is lost (its host unreachable).
        self._wait_all(
            refs, within_s=plan.setup_timeout_s + WORKER_CALL_TIMEOUT_S, what="process-group set-up"
        )
        t2 = time.perf_counter()
        logger.info("tpuray.train: workers started in %.2fs, process group up in %.2fs", t1 - t0, t2 - t1)

    def _start_group(self) -> None:
        """Reserve and start the workers (bounded by the spec's reserve_timeout_s), aborted when a
        reserved host drains or dies meanwhile."""
        try:
            lost = start_group(self.group, POLL_S)
        except SliceReservationTimeout:
            raise
        except (ray.exceptions.RayActorError, TimeoutError) as exc:  # a host lost while workers start
            raise WorkerDied(None, exc) from exc
        if lost is not None and lost.preempted:
            raise Preempted(lost.info, checkpointed=False, how="while its workers started")
        if lost is not None:
            raise WorkerDied(None, RuntimeError(str(lost)))

    def _session_args(self, index: int) -> tuple:
        plan = self.plan
        rank = self.group.members[index].rank
        shards = self.shards.for_rank(index) if self.shards is not None else None
        return (
            self._context(rank),
            self.restored,
            self.state.base,
            plan.upload_mode,
            shards,
            plan.upload_timeout_s,
        )

    def _context(self, rank: RankInfo) -> TrainContext:
        plan = self.plan
        return TrainContext(
            world_rank=rank.world_rank,
            world_size=rank.world_size,
            local_rank=rank.local_rank,
            local_world_size=rank.local_world_size,
            node_rank=rank.node_rank,
            experiment_name=plan.name,
            storage_path=plan.storage_path,
            run_path=plan.run_path,
            device_type=device_type_for(plan.backend),
            emulated=self.group.emulated,
            attempt=self.number,
            metadata=plan.metadata,
        )

    # -- the wait loop --------------------------------------------------------------------------
    def _wait_all(self, refs: list, within_s: float | None = None, what: str = "") -> list:
        """Wait for calls on the workers (refs in rank order, possibly several rounds) while draining
        reports and watching for a preemption; raise on the first failure. With `within_s`, ranks still
        busy after it are lost (WorkerDied: a worker failure)."""
        index_of = {ref: i for i, ref in enumerate(refs)}
        outcomes: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = None if within_s is None else time.monotonic() + within_s
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                ranks = sorted({index_of[ref] % self.group.world_size for ref in pending})
                raise WorkerDied(
                    ranks[0], TimeoutError(f"{what} on rank(s) {ranks} did not finish within {within_s:g}s")
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in ready:
                index = index_of[ref]
                outcomes[index] = self._outcome(ref, index % self.group.world_size)
            self._collect()
            if pending:
                self._check_preemption()
        return outcomes

    def _outcome(self, ref: Any, rank: int) -> Any:
        """What one call answered; a worker's error classified (a lost worker, a storage timeout: retried;
        anything else: the user's error, WorkerGroupError)."""
        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(rank, exc) from exc
        except ray.exceptions.RayTaskError as exc:  # set-up failed (e.g. process group init)
            self._fail(rank, exc.as_instanceof_cause(), str(exc))
        if isinstance(out, WorkerOutcome) and not out.ok:
            if isinstance(out.error, CheckpointUploadTimeout):  # storage gone: retried, not fatal
                self._collect_quietly()
                raise WorkerDied(rank, out.error)
            self._fail(rank, out.error, out.traceback)
        return out

    def _fail(self, rank: int, error: BaseException | None, traceback: str) -> None:
        """A worker raised: keep what the others reported, then fail the run with the error, unless a
        peer is gone (the error is its echo: a worker failure)."""
        self._collect_quietly()
        self._check_peers_alive(error)
        errors: dict[int, Any] = {rank: error}
        raise WorkerGroupError(f"Training failed: worker rank {rank} raised:\n{traceback}", errors)

    def _check_peers_alive(self, error: BaseException | None) -> None:
        """A worker error can be the echo of a peer's death (gloo/tpu_dist "connection closed by peer"):
        ping every worker; if one is dead or unresponsive, it is a worker failure (retried), not a user
        error. Ray may need a while to declare a killed host dead, hence the generous timeout."""
        try:
            ray.get([m.actor.ping.remote() for m in self.group.members], timeout=WORKER_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise WorkerDied(None, exc) from error

    def _collect(self) -> None:
        """Drain every worker's report records (a worker that cannot answer at once is lost) and hand
        them to on_records."""
        refs = self.group.call("drain")
        try:
            per_rank = ray.get(refs, timeout=WORKER_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(None, exc) from exc
        except ray.exceptions.GetTimeoutError as exc:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            silent = [rank for rank, ref in enumerate(refs) if ref not in ready]
            cause = TimeoutError(
                f"worker rank(s) {silent} did not hand over their reports within {WORKER_CALL_TIMEOUT_S:g}s "
                "(host lost or unresponsive)"
            )
            raise WorkerDied(silent[0] if silent else None, cause) from exc
        self.on_records(
            [(m.rank.world_rank, records) for m, records in zip(self.group.members, per_rank, strict=True)]
        )

    def _collect_quietly(self) -> None:
        try:
            self._collect()
        except WorkerDied:
            pass

    def _check_preemption(self) -> None:
        """On a drain of the run's hosts: tell every worker (get_preemption_info(), should_checkpoint()),
        then end the attempt once no report made before the notice can be lost (the newest committed
        checkpoint covers it) or when the deadline is DEADLINE_MARGIN_S away."""
        assert self.watch is not None  # set once the group started
        info = self.watch.poll()
        if info is None:
            return
        notice = self.notice
        if notice is None or notice[0] != info:
            notice = self._notify(info)
        info, last = notice
        state = self.state
        if last < state.base or (state.latest_ckpt is not None and state.latest_ckpt >= last):
            raise Preempted(info, checkpointed=last >= state.base)
        left = info.seconds_left()
        if left is not None and left <= DEADLINE_MARGIN_S:
            raise Preempted(info, checkpointed=False, how="at the deadline, without a new checkpoint")

    def _notify(self, info: PreemptionInfo) -> tuple[PreemptionInfo, int]:
        """Hand a new (or changed) notice to every worker; the first one fixes the last report before it."""
        previous = self.notice
        # The loop reads the notice between steps; each worker answers with the reports it has made
        # (the driver sees a report only once its checkpoint is uploaded).
        try:
            made = ray.get(self.group.call("notify_preemption", info), timeout=PREEMPTION_NOTIFY_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise Preempted(info, checkpointed=False) from exc
        last = max([*made, *self.state.counts]) - 1 if previous is None else previous[1]
        self.notice = (info, last)
        if previous is None:
            self.progress.note(
                f"tpuray.train: preemption notice for {describe(info)}; asking for a checkpoint"
            )
        return self.notice
