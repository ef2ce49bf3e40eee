"""`RLRun`: a `tpuray.train` trainer and a `RolloutEngine` placed by `RLConfig`, joined by a batch ->
train -> weight-sync loop (issue 23, item 3). The driver generates (your `rollout_fn`), hands each batch
to every trainer rank, waits for the ranks' new weights (`tpuray.rl.sync`) and loads them into the
engine; with `overlap=True` it generates batch k+1 while the trainer trains on batch k.

    def train_loop(config):                        # runs on every trainer rank (tpuray.train worker)
        rl = config["rl"]                          # a SyncTarget
        for k in range(rl.iterations):
            batch = rl.batch(k)                    # what rollout_fn(engine, k) returned
            ...one or more optimizer steps...
            rl.send(model, version=k + 1)          # FSDP2: each rank its shard; DDP: rank 0 all

    result = RLRun(RLConfig(rollout_cfg, scaling), train_loop).run(iterations, rollout_fn)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from tpuray.rl.config import RLConfig
from tpuray.rl.reserve import capacity_shortfall, claim_slices
from tpuray.rl.result import IterationStats, RLResult, RLRunError
from tpuray.rl.rollout.engine import RolloutEngine, RolloutEngineError, UpdateLostError
from tpuray.rl.rollout.factory import rollout_engine
from tpuray.rl.rollout.hosted import all_alive
from tpuray.rl.sync.driver import WeightSync
from tpuray.rl.sync.mailbox import batch_key
from tpuray.rl.trainer_side import TrainerSide
from tpuray.rl.weights.check import WeightMismatchError
from tpuray.slices.claim import SliceClaim
from tpuray.slices.placement import SliceReservationTimeout
from tpuray.validation import ConfigError

__all__ = ["IterationStats", "RLConfig", "RLResult", "RLRun", "RLRunError"]

logger = logging.getLogger(__name__)

RolloutFn = Callable[[RolloutEngine, int], Any]


class RLRun:
    """Runs `train_loop` under tpuray.train and the rollout engine as `config` places them (module doc).
    Reservation is all or nothing: the cluster's slices are counted first (too few: RLRunError, nothing
    reserved), then both sides' slices are claimed in one request (tpuray.rl.reserve: a SliceClaim,
    waiting up to the shorter side's reservation timeout), then the rollout engine reserves its claimed
    slice and the trainer (fit()) its own; any failure on the way, or of either side later, releases
    both and raises RLRunError. Colocated: only the trainer's
    slice is reserved, and the engine starts in its workers once they wait for batch 0.

    Trainer restarts: with `run_config=RunConfig(failure_config=FailureConfig(max_failures=N))` (N != 0)
    a lost trainer worker or host restarts the trainer's worker group (tpuray.train's fault tolerance);
    the loop resumes from `tpuray.train.get_checkpoint()` and takes the batches after it again (the
    driver keeps them), the engine loads the versions it re-sends (over "tpu_dist" each attempt forms its
    own group with the engine's workers; colocated, the next engine starts in the new workers with the
    last update: `_hosted_engine`, docs/rl.md "Colocated restarts"). Past N, or a
    rollout-side failure past RLConfig.rollout_max_failures (a failed engine replaced: `_restart_engine`):
    RLRunError."""

    def __init__(
        self,
        config: RLConfig,
        train_loop: Callable[[dict], Any],
        *,
        train_loop_config: dict | None = None,
        run_config: Any = None,
    ) -> None:
        from tpuray.train import RunConfig

        if not isinstance(config, RLConfig):
            raise TypeError(f"config must be an RLConfig, got {type(config).__name__}")
        run_config = run_config or RunConfig()
        if not isinstance(run_config, RunConfig):
            raise ConfigError(f"run_config must be a tpuray.train.RunConfig, got {run_config!r}")
        self.config = config
        # the loop, its config and the RunConfig are the trainer side's (fit() in a driver thread)
        self._trainer = TrainerSide(train_loop, dict(train_loop_config or {}), config.trainer, run_config)
        self._engine: RolloutEngine | None = None  # disaggregated: from run(); colocated: from batch 0
        self._versions: list[int] = []  # loaded into the engine, in order (RLResult.versions)
        self._attempt = 0  # the trainer attempt whose updates the engine loads
        self._engine_attempt = 0  # colocated: the trainer attempt whose workers host the engine
        self._engine_hosts: list[Any] = []  # colocated: those workers' actor handles, in rank order
        self._last_update: Any = None  # the latest update the engine loaded: a new engine reloads it
        self._rollout_restarts = 0

    def run(self, iterations: int, rollout_fn: RolloutFn) -> RLResult:
        """`iterations` rounds of rollout_fn(engine, k) -> trainer batch k -> weights k+1 -> engine."""
        if not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations={iterations!r} is invalid; valid: an integer >= 1")
        claim = self._reserve_claim()  # disaggregated: both sides' slices in one request
        self._versions, self._attempt, self._last_update, self._rollout_restarts = [], 0, None, 0
        if claim is not None:
            try:  # the rollout slice, a claimed one (or raises, nothing held)
                self._engine = rollout_engine(self.config.rollout)
            except BaseException:
                claim.close()
                raise
        try:
            vllm_config, model_config = self._model_configs()
            sync = WeightSync(
                self.config.rollout_tensor_parallel_size,
                self.config.trainer_world_size,
                self.config.sync_timeout_s,
                self.config.weight_sync,
                vllm_config=vllm_config,
                colocated=self.config.placement == "colocated",
                model_config=model_config,
            )
        except BaseException:
            self._shutdown_engine()
            if claim is not None:
                claim.close()
            raise
        try:
            self._trainer.start(dataclasses.replace(sync.target, iterations=iterations))
            batches, times = self._loop(sync, iterations, rollout_fn)
            return RLResult(self._trainer.result(), batches, times, self._rollout_restarts, self._versions)
        except BaseException as e:
            if self.config.placement == "disaggregated":
                self._shutdown_engine()  # first: a trainer rank mid-send over tpu_dist then fails, not waits
            self._trainer.stop(sync)
            if isinstance(e, RLRunError):
                raise
            side = (
                "the driver"
                if isinstance(e, KeyboardInterrupt)
                else "the rollout side (engine or rollout_fn)"
            )
            raise RLRunError(f"the RL run ended: {side} failed ({type(e).__name__}: {e})") from e
        finally:
            sync.shutdown()
            self._shutdown_engine()
            if claim is not None:  # closed already once the trainer's slice(s) were reserved too
                claim.close()

    def _reserve_claim(self) -> SliceClaim | None:
        """Before starting anything: both sides' slices must exist at once, then (disaggregated) are
        claimed in one request (tpuray.rl.reserve); else RLRunError, nothing reserved."""
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "RLRun.run needs this process connected to a Ray cluster with the slices (ray.init)"
            )
        shortfall = capacity_shortfall(self.config)
        if shortfall is not None:
            raise RLRunError(shortfall)
        try:
            return claim_slices(self.config)
        except SliceReservationTimeout as e:
            raise RLRunError(f"the RL run could not reserve its slices at once: {e}") from e

    def _model_configs(self) -> tuple[dict | None, dict | None]:
        """(vllm_config, model_config) for `WeightSync`, config.json read once: a vLLM engine's layout
        is cut by it (None: the embedded engine's), and a colocated run over "tpu_dist" cuts each
        engine rank's part on the trainer's ranks by it (`tpuray.rl.sync.handover`; None otherwise)."""
        vllm = self.config.rollout.resolved_engine == "vllm"
        handover = self.config.placement == "colocated" and self.config.weight_sync == "tpu_dist"
        config = self.config.rollout.model_config() if vllm or handover else None
        return (config if vllm else None), (config if handover else None)

    def _shutdown_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    # -- the loop -----------------------------------------------------------------------------------------
    def _loop(
        self, sync: WeightSync, iterations: int, rollout_fn: RolloutFn
    ) -> tuple[list[Any], list[IterationStats]]:
        import ray

        overlap = self.config.overlap
        batches, times = [], []
        batch, freed = self._rollout(sync, 0, rollout_fn)
        for k in range(iterations):
            t0 = time.perf_counter()
            ref = ray.put(batch)
            sync.put_all({batch_key(k, rank): [ref] for rank in range(sync.world_size)})
            batches.append(batch)
            more = k + 1 < iterations
            rollout_s, upcoming = 0.0, None
            if overlap and more:  # generate k+1 with the current weights while the trainer trains on k
                upcoming = self._rollout(sync, k + 1, rollout_fn)
                rollout_s = time.perf_counter() - t0
            update, wait_s, sync_s = self._sync_to(sync, k + 1)
            t3 = time.perf_counter()
            if not overlap and more:
                upcoming = self._rollout(sync, k + 1, rollout_fn)
                rollout_s = time.perf_counter() - t3
            senders = max(len(refs) for refs in update.refs)
            total = time.perf_counter() - t0
            nbytes, held = sum(update.nbytes), sync.batches_held()
            times.append(IterationStats(rollout_s, wait_s, sync_s, total, nbytes, senders, freed, held))
            if upcoming is not None:
                batch, freed = upcoming
        return batches, times

    def _rollout(self, sync: WeightSync, k: int, rollout_fn: RolloutFn) -> tuple[Any, int]:
        """(batch k, bytes the engine then freed). Colocated: once every trainer rank waits for it, the
        engine (started in the trainer's workers, woken up after) generates, then sleeps so that the
        trainer has the chips. A colocated engine lost with a trainer worker (FailureConfig restarts):
        the next one starts in the restarted attempt's workers, with the last update."""
        if self.config.placement == "disaggregated":
            return self._on_engine(sync, lambda engine: rollout_fn(engine, k)), 0
        while True:
            attempt, hosts = sync.ready(k, self._trainer.alive, functools.partial(self._take_update, sync))
            try:
                engine = self._hosted_engine(attempt, hosts)
                batch = rollout_fn(engine, k)
                return batch, engine.sleep(self.config.sleep_level)
            except RolloutEngineError as e:
                self._drop_lost_engine(e, hosts)

    def _hosted_engine(self, attempt: int, hosts: list[Any]) -> RolloutEngine:
        """Colocated: the engine in trainer attempt `attempt`'s workers `hosts`, awake."""
        if self._engine is not None and self._engine_attempt != attempt:
            self._shutdown_engine()  # its workers were an earlier attempt's
        if self._engine is not None:
            self._engine.wake_up()
            return self._engine
        self._engine = rollout_engine(self.config.rollout, hosts)
        self._engine_attempt, self._engine_hosts = attempt, hosts
        if self._last_update is not None:  # its objects are the mailbox's: they outlive a lost attempt
            try:
                self._engine.update_weights(self._last_update)
            except UpdateLostError as e:  # ... but not a lost host, which held them
                self._shutdown_engine()
                raise RLRunError(
                    f"the RL run ended: the engine started in trainer attempt {attempt}'s workers cannot "
                    f"load update {self._last_update.version}, whose pieces were lost with the worker or "
                    f"host that held them ({e}); a train loop that resumes from a checkpoint should send its restored "
                    "weights before its first rl.batch (rl.send(model, version=<the checkpoint's version>)): "
                    "the new engine then loads those"
                ) from e
        return self._engine

    def _drop_lost_engine(self, error: RolloutEngineError, hosts: list[Any]) -> None:
        """Colocated: an engine that failed because one of its workers `hosts` died with a trainer worker
        is dropped when the trainer restarts (FailureConfig); any other failure is raised."""
        if not self._trainer.restarts or all_alive(hosts):
            raise error
        logger.warning(
            "tpuray.rl: the colocated engine failed with a trainer worker (%s); the restarted trainer's "
            "workers will host the next one",
            error,
        )
        self._shutdown_engine()

    def _sync_to(self, sync: WeightSync, version: int) -> tuple[Any, float, float]:
        """Load the trainer's updates into the engine up to `version`'s: (that update, seconds waiting
        for updates, seconds loading them). After a trainer restart (tpuray.train fault tolerance) the
        new attempt resumes from its checkpoint and re-sends the versions after it, the engine may
        already hold: each is loaded again (the restarted trainer's state wins)."""
        wait_s = sync_s = 0.0
        held = self._last_update
        if held is not None and held.attempt == self._attempt and held.version >= version:
            self._versions.append(held.version)  # loaded into a replaced engine during the rollout
            return held, wait_s, sync_s
        while True:
            t0 = time.perf_counter()
            update = sync.receive(self._trainer.alive)
            t1 = time.perf_counter()
            taken = self._take_update(sync, update)
            wait_s, sync_s = wait_s + t1 - t0, sync_s + time.perf_counter() - t1
            if taken and update.version >= version:
                return update, wait_s, sync_s

    def _take_update(self, sync: WeightSync, update: Any) -> bool:
        """Load `update` into the engine (the last one the rollout side holds); False when it was lost
        with its sender. Colocated without an engine (lost with a trainer attempt): kept for the next
        engine, and acknowledged."""
        self._note_attempt(update)
        if self.config.placement == "disaggregated":
            try:
                self._on_engine(sync, functools.partial(self._update, sync=sync, update=update))
            except UpdateLostError as e:
                self._lost(update, e)
                return False
        else:
            self._load_hosted(sync, update)
        self._last_update = update
        self._versions.append(update.version)
        return True

    def _lost(self, update: Any, error: UpdateLostError) -> None:
        """Disaggregated: a trainer rank died after it sent `update` (its objects, or its offer over
        tpu_dist) and before the engine had it. With trainer restarts the restarted attempt sends it
        again; else the run ends."""
        if not self._trainer.restarts:
            raise RLRunError(
                f"the RL run ended: update {update.version} was lost with a trainer rank before the engine "
                f"loaded it ({error}); with RunConfig(failure_config=FailureConfig(max_failures=N)) the "
                "restarted trainer sends it again"
            ) from error
        logger.warning(
            "tpuray.rl: update %d (trainer attempt %d) was lost with a trainer rank before the engine "
            "loaded it; the engine keeps its weights until the restarted trainer sends it again",
            update.version,
            update.attempt,
        )

    def _load_hosted(self, sync: WeightSync, update: Any) -> None:
        if self._engine is not None and self._engine_attempt != update.attempt:
            self._shutdown_engine()  # its workers were an earlier attempt's
        if self._engine is None:
            sync.ack(update)
            return
        try:
            self._load(self._engine, sync, update)
        except RolloutEngineError as e:  # the sender's attempt is lost too: no acknowledgement awaited
            self._drop_lost_engine(e, self._engine_hosts)

    def _note_attempt(self, update: Any) -> None:
        if update.attempt != self._attempt:
            logger.warning(
                "tpuray.rl: the trainer restarted (attempt %d); it resumed at weight version %d, the "
                "engine continues from it",
                update.attempt,
                update.version,
            )
            self._attempt = update.attempt

    def _on_engine(self, sync: WeightSync, call: Callable[[RolloutEngine], Any]) -> Any:
        """`call(engine)`; where the engine failed (RolloutEngineError) and RLConfig.rollout_max_failures
        allows, replace the engine and call again."""
        while True:
            assert self._engine is not None  # disaggregated: made by run(); colocated: by the first _rollout
            try:
                return call(self._engine)
            except RolloutEngineError as e:
                limit = self.config.rollout_max_failures
                if limit != -1 and self._rollout_restarts >= limit:
                    raise
                self._restart_engine(sync, e)

    def _restart_engine(self, sync: WeightSync, error: BaseException) -> None:
        """Shut the failed engine down (its slice released), reserve a new one and load the last update
        the old one had (its ObjectRefs are still held here)."""
        self._rollout_restarts += 1
        logger.warning(
            "tpuray.rl: the rollout engine failed (%s); replacing it (restart %d of %s)",
            error,
            self._rollout_restarts,
            "unlimited" if self.config.rollout_max_failures == -1 else self.config.rollout_max_failures,
        )
        self._shutdown_engine()
        self._engine = rollout_engine(self.config.rollout)
        sync.replace_engine()  # tpu_dist: the trainer's ranks send their last update again, into it
        if self._last_update is None:
            return
        if self.config.weight_sync == "object_store":
            self._engine.update_weights(self._last_update)
            return
        update = sync.receive(self._trainer.alive)  # the last one loaded, or (overlap) the one after it
        self._note_attempt(update)
        self._load(self._engine, sync, update)
        self._last_update = update

    def _update(self, engine: RolloutEngine, sync: WeightSync, update: Any) -> None:
        held = self._last_update
        if (
            held is not None
            and held is not update
            and (held.attempt, held.version)
            == (
                update.attempt,
                update.version,
            )
        ):
            return  # tpu_dist: the engine failed while loading it; its replacement took it again
        self._load(engine, sync, update)

    def _load(self, engine: RolloutEngine, sync: WeightSync, update: Any) -> None:
        try:
            engine.update_weights(update)  # checked by the engine's workers before anything is staged
        except WeightMismatchError as e:
            sync.ack(update, error=str(e))  # the trainer's ranks raise it too
            raise RLRunError(
                f"the RL run ended: the trainer's update {update.version} was refused: {e}"
            ) from e
        sync.ack(update)
