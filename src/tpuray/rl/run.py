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
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tpuray.rl.config import RolloutConfig
from tpuray.rl.engine import RolloutEngine
from tpuray.rl.sync import TRANSPORTS, Transport, WeightSync
from tpuray.validation import ConfigError

logger = logging.getLogger(__name__)

Placement = Literal["disaggregated", "colocated"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
RolloutFn = Callable[[RolloutEngine, int], Any]
STOP_TIMEOUT_S = 120.0  # for the trainer's workers to end once the run failed


class RLRunError(RuntimeError):
    """The RL run ended because one side failed (the trainer run, the rollout engine or a weight sync);
    the cause is chained. Everything the run reserved was released."""


@dataclass
class RLConfig:
    """Where an RL run's trainer and rollout engine run, and how their phases interleave; validated at
    construction, before anything is reserved."""

    rollout: RolloutConfig
    """The rollout engine: model, slice (`accelerator_type`, `topology`) and tensor parallelism."""
    trainer: Any
    """The trainer's workers: a `tpuray.train.ScalingConfig` (TPU slices for `use_tpu=True`)."""
    placement: Placement = "disaggregated"
    """"disaggregated": trainer and rollout engine each on slices of their own (`trainer`'s and
    `rollout`'s), reserved for the whole run; the phases can overlap.
    "colocated": one slice, the trainer's, reserved once; the rollout engine (embedded, tensor parallel
    over the trainer's ranks) runs inside the trainer's worker processes and the phases take turns on
    the same chips: generate, engine `sleep()` (its memory freed), train, weight sync into the sleeping
    engine, `wake_up()`. `rollout` then names no slice of its own (`tpuray.rl.colocate`, docs/rl.md)."""
    overlap: bool = False
    """Disaggregated only: generate batch k+1 (with the weights of step k-1) while the trainer trains on
    batch k, i.e. off-policy by one step; False is on-policy (generate, then train, then sync)."""
    weight_sync: Transport = "tpu_dist"
    """How the trainer's weights reach the rollout engine's workers; either way each trainer rank sends
    every rollout tensor-parallel rank only the rows of its part that it holds, no copy passes the
    driver, and a name or shape mismatch is refused before anything is overwritten.
    "tpu_dist" (the default: 1.6x-3.4x faster per sync than "object_store" in benchmarks/bench_rl.py,
    docs/rl.md): a torch.distributed process group (the "tpu_dist" backend, TCPStore rendezvous on the
    driver) spanning the trainer's and the engine's workers; only the pieces' metadata passes the
    driver, which checks it before the ranks send the data point to point (`tpuray.rl.collective`).
    "object_store": every trainer rank `ray.put`s one object per rollout rank, only the ObjectRefs pass
    the driver, each rollout rank pulls its objects and checks them (no process group between the two
    sides: use it where the slices cannot reach each other's TCP ports). It is the one transport of
    placement="colocated" (the engine's ranks are the trainer's own processes: there is no second side
    for a process group to span), which refuses "tpu_dist": pass weight_sync="object_store" there."""
    sync_timeout_s: float = 600.0
    """How long a trainer rank waits for a batch or for the engine to take its weights."""
    trainer_world_size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        from tpuray.train import ScalingConfig

        if not isinstance(self.rollout, RolloutConfig):
            raise ConfigError(f"RLConfig.rollout must be a tpuray.rl.RolloutConfig, got {self.rollout!r}")
        if not isinstance(self.trainer, ScalingConfig):
            raise ConfigError(f"RLConfig.trainer must be a tpuray.train.ScalingConfig, got {self.trainer!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"RLConfig.placement={self.placement!r} is invalid; valid: {', '.join(PLACEMENTS)}"
            )
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"RLConfig.overlap={self.overlap!r} is invalid; valid: True, False")
        if self.weight_sync not in TRANSPORTS:
            raise ConfigError(
                f"RLConfig.weight_sync={self.weight_sync!r} is invalid; valid: {', '.join(TRANSPORTS)}"
            )
        if not isinstance(self.sync_timeout_s, int | float) or self.sync_timeout_s <= 0:
            raise ConfigError(f"RLConfig.sync_timeout_s={self.sync_timeout_s!r} is invalid; valid: > 0")
        self.trainer_world_size = self.trainer.num_workers
        if self.placement == "colocated":
            self._check_colocated()
        else:
            self._check_disaggregated()

    def _check_disaggregated(self) -> None:
        if self.rollout.resolved_engine != "embedded":
            raise ConfigError(
                f"RLConfig.rollout: an RLRun's weight sync loads into the embedded engine's tensor-parallel "
                f"workers; the rollout engine resolved to {self.rollout.resolved_engine!r} (vLLM's workers take "
                "full tensors through its weight loaders: RolloutEngine.update_weights(state_dict)); valid: "
                "RolloutConfig(engine='embedded')"
            )
        if not self.rollout.on_slice or not self.trainer.use_tpu:
            raise ConfigError(
                f"RLConfig.placement='disaggregated' puts the trainer and the rollout engine on slices of "
                f"their own: RolloutConfig(accelerator_type={self.rollout.accelerator_type!r}, "
                f"topology={self.rollout.topology!r}) and ScalingConfig(use_tpu={self.trainer.use_tpu!r}) "
                "must both name a TPU slice"
            )

    def _check_colocated(self) -> None:
        rollout, trainer = self.rollout, self.trainer
        if self.overlap:
            raise ConfigError(
                "RLConfig.overlap=True is invalid with placement='colocated' (the engine and the trainer "
                "take turns on the same chips: nothing can overlap); valid: overlap=False, or "
                "placement='disaggregated'"
            )
        if rollout.resolved_engine != "embedded":
            raise ConfigError(
                f"RLConfig.placement='colocated' with RolloutConfig.engine={rollout.engine!r} (runs vLLM): "
                "the engine must sleep while the trainer trains, and vLLM's sleep mode is unavailable on "
                "vLLM's CPU platform (its CPU build and emulated TPU slices), besides running in worker "
                "processes of its own; valid: engine='embedded'"
            )
        if rollout.on_slice:
            raise ConfigError(
                f"RLConfig.placement='colocated' runs the rollout engine on the trainer's slice: "
                f"RolloutConfig(accelerator_type={rollout.accelerator_type!r}, topology={rollout.topology!r}) "
                "must be None (the engine's tensor parallelism is the trainer's ranks)"
            )
        if not trainer.use_tpu or (trainer.num_slices or 1) != 1:
            raise ConfigError(
                f"RLConfig.placement='colocated' needs one TPU slice for the trainer: "
                f"ScalingConfig(use_tpu={trainer.use_tpu!r}, num_slices={trainer.num_slices!r}); "
                "valid: use_tpu=True on one slice"
            )
        if self.weight_sync != "object_store":
            raise ConfigError(
                f"RLConfig.weight_sync={self.weight_sync!r} is invalid with placement='colocated': its "
                "process group spans the trainer's and the engine's workers, and colocated they are the same "
                "processes (each rank's pieces go to its own engine rank through its host's object store); "
                "valid: weight_sync='object_store'"
            )

    @property
    def rollout_tensor_parallel_size(self) -> int:
        """The rollout engine's ranks: its own slice's (disaggregated) or the trainer's (colocated)."""
        if self.placement == "colocated":
            return self.trainer_world_size
        return self.rollout.tensor_parallel_size


@dataclass(frozen=True)
class IterationStats:
    """One iteration on the driver: seconds in `rollout` (rollout_fn of the next batch: generate + reward;
    with overlap, while the trainer trains), `wait` (for the trainer's weights, beyond the rollout),
    `sync` (update_weights: transfer + load; after a trainer restart, with the versions it re-sent) and
    `total`; `sync_bytes` the rollout ranks received, each from up
    to `senders` trainer ranks; `freed` (colocated) what the engine released on the chips for training."""

    rollout: float
    wait: float
    sync: float
    total: float
    sync_bytes: int
    senders: int
    freed: int = 0  # colocated: bytes the engine's sleep() freed on the chips before the trainer trained


@dataclass
class RLResult:
    """What `RLRun.run` returns: the trainer's `tpuray.train.Result`, each iteration's batch as
    rollout_fn returned it (its time split in `times`)."""

    train_result: Any
    batches: list[Any]
    times: list[IterationStats]
    versions: list[int] = field(default_factory=list)
    """The weight versions the engine loaded, in order: 1..iterations, plus, after a trainer restart, the
    versions after its checkpoint again (the restarted trainer's state replaces the lost one's)."""


def _check_restarts(config: RLConfig, max_failures: int) -> None:
    """Trainer restarts (FailureConfig(max_failures) != 0) need the engine on a slice of its own, which
    outlives the trainer's workers (docs/rl.md, "Reservation and failures")."""
    if max_failures == 0:
        return
    if config.placement == "colocated":
        raise ConfigError(
            f"FailureConfig(max_failures={max_failures}) with RLConfig.placement='colocated' is not "
            "supported: the engine runs in the trainer's workers, and a restart replaces them; valid: "
            "max_failures=0, or placement='disaggregated'"
        )


class RLRun:
    """Runs `train_loop` under tpuray.train and the rollout engine as `config` places them (module doc).
    Reservation is all or nothing: the cluster's slices are counted first (too few: RLRunError, nothing
    reserved), then the rollout engine's slice is reserved, then the trainer's (fit()); any failure on the
    way, or of either side later, releases both and raises RLRunError. Colocated: only the trainer's
    slice is reserved, and the engine starts in its workers once they wait for batch 0.

    Trainer restarts: with `run_config=RunConfig(failure_config=FailureConfig(max_failures=N))` (N != 0;
    disaggregated only, colocated refused by name) a lost trainer worker or host restarts the trainer's
    worker group (tpuray.train's fault tolerance); the loop resumes from `tpuray.train.get_checkpoint()`
    and takes the batches after it again (the driver keeps them), the engine loads the versions it
    re-sends (over "tpu_dist" each attempt forms its own group with the engine's workers). Past N, or a
    rollout-side failure: RLRunError."""

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
        _check_restarts(config, run_config.failure_config.max_failures)
        self.config = config
        self.train_loop = train_loop
        self.train_loop_config = dict(train_loop_config or {})
        self.run_config = run_config
        self._fit_out: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self._engine: RolloutEngine | None = None  # disaggregated: from run(); colocated: from batch 0
        self._versions: list[int] = []  # loaded into the engine, in order (RLResult.versions)
        self._attempt = 0  # the trainer attempt whose updates the engine loads

    def run(self, iterations: int, rollout_fn: RolloutFn) -> RLResult:
        """`iterations` rounds of rollout_fn(engine, k) -> trainer batch k -> weights k+1 -> engine."""
        if not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations={iterations!r} is invalid; valid: an integer >= 1")
        self._check_capacity()
        self._versions, self._attempt = [], 0
        if self.config.placement == "disaggregated":  # reserves the rollout slice (or raises, nothing held)
            self._engine = RolloutEngine(self.config.rollout)
        try:
            sync = WeightSync(
                self.config.rollout_tensor_parallel_size,
                self.config.trainer_world_size,
                self.config.sync_timeout_s,
                self.config.weight_sync,
            )
        except BaseException:
            self._shutdown_engine()
            raise
        try:
            self._start_trainer(sync, iterations)
            batches, times = self._loop(sync, iterations, rollout_fn)
            return RLResult(self._finish(), batches, times, self._versions)
        except BaseException as e:
            if self.config.placement == "disaggregated":
                self._shutdown_engine()  # first: a trainer rank mid-send over tpu_dist then fails, not waits
            self._stop(sync)
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

    def _shutdown_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def _check_capacity(self) -> None:
        """Before reserving anything: the cluster must hold enough intact slices of each side's shape at
        once (the rollout engine's and the trainer's num_slices), else RLRunError listing its slices."""
        import ray

        from tpuray.slices.inventory import format_slices, list_slices
        from tpuray.topology import SliceTopology

        if not ray.is_initialized():
            raise RuntimeError(
                "RLRun.run needs this process connected to a Ray cluster with the slices (ray.init)"
            )
        rollout, trainer = self.config.rollout, self.config.trainer
        assert trainer.slice_topology is not None and trainer.num_slices is not None
        need: dict[str, int] = {}
        if self.config.placement == "disaggregated":
            assert rollout.accelerator_type is not None and rollout.topology is not None  # RLConfig checked
            need[SliceTopology.parse(rollout.accelerator_type, rollout.topology).pod_type] = 1
        pod = trainer.slice_topology.pod_type
        need[pod] = need.get(pod, 0) + trainer.num_slices
        slices = list_slices()
        for pod, n in need.items():
            have = sum(1 for s in slices if s.pod_type == pod and s.intact and not s.draining)
            if have < n:
                raise RLRunError(
                    f"the RL run needs {n} x {pod} slice(s) at once (the rollout engine's and the trainer's); "
                    f"this cluster has {have}; nothing was reserved. TPU slices:\n{format_slices(slices)}"
                )

    # -- the trainer --------------------------------------------------------------------------------------
    def _start_trainer(self, sync: WeightSync, iterations: int) -> None:
        from tpuray.train.torch import TorchTrainer

        colocated = self.config.placement == "colocated"
        target = dataclasses.replace(sync.target, iterations=iterations, colocated=colocated)
        trainer = TorchTrainer(
            self.train_loop,
            train_loop_config={**self.train_loop_config, "rl": target},
            scaling_config=self.config.trainer,
            run_config=self.run_config,
        )
        out = self._fit_out = {}

        def fit() -> None:
            try:
                out["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001 - raised on the driver's thread by _alive
                out["error"] = e

        self._thread = threading.Thread(target=fit, name="tpuray-rl-trainer", daemon=True)
        self._thread.start()

    def _alive(self) -> None:
        """Raise RLRunError when the trainer run ended (it should be waiting on the mailbox)."""
        assert self._thread is not None
        if self._thread.is_alive():
            return
        error = self._fit_out.get("error")
        if error is not None:
            raise RLRunError(
                f"the RL run ended: the trainer failed ({type(error).__name__}: {error})"
            ) from error
        raise RLRunError("the RL run ended: the trainer's loop returned before sending all its updates")

    def _finish(self) -> Any:
        assert self._thread is not None
        self._thread.join()
        if "result" not in self._fit_out:
            self._alive()
        return self._fit_out["result"]

    def _stop(self, sync: WeightSync) -> None:
        """End the trainer run: its ranks' next mailbox call fails (SyncError), fit() fails and releases
        its slice; wait for that (bounded)."""
        sync.shutdown()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                logger.error(
                    "tpuray.rl: the trainer run did not end within %ss of the failure", STOP_TIMEOUT_S
                )

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
            for rank in range(sync.world_size):
                sync.put(f"batch/{k}/{rank}", [ref])
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
            times.append(IterationStats(rollout_s, wait_s, sync_s, total, sum(update.nbytes), senders, freed))
            if upcoming is not None:
                batch, freed = upcoming
        return batches, times

    def _rollout(self, sync: WeightSync, k: int, rollout_fn: RolloutFn) -> tuple[Any, int]:
        """(batch k, bytes the engine then freed). Colocated: once every trainer rank waits for it, the
        engine (started in the trainer's workers at k=0, woken up after) generates, then sleeps so that
        the trainer has the chips."""
        if self.config.placement == "disaggregated":
            assert self._engine is not None
            return rollout_fn(self._engine, k), 0
        hosts = sync.ready(k, self._alive)
        if self._engine is None:
            from tpuray.rl.colocate import ColocatedRolloutEngine

            self._engine = ColocatedRolloutEngine(self.config.rollout, hosts)
        else:
            self._engine.wake_up()
        batch = rollout_fn(self._engine, k)
        return batch, self._engine.sleep()

    def _sync_to(self, sync: WeightSync, version: int) -> tuple[Any, float, float]:
        """Load the trainer's updates into the engine up to `version`'s: (that update, seconds waiting
        for updates, seconds loading them). After a trainer restart (tpuray.train fault tolerance) the
        new attempt resumes from its checkpoint and re-sends the versions after it, the engine may
        already hold: each is loaded again (the restarted trainer's state wins)."""
        wait_s = sync_s = 0.0
        while True:
            t0 = time.perf_counter()
            update = sync.receive(self._alive)
            t1 = time.perf_counter()
            if update.attempt != self._attempt:
                logger.warning(
                    "tpuray.rl: the trainer restarted (attempt %d); it resumed at weight version %d, the "
                    "engine continues from it",
                    update.attempt,
                    update.version,
                )
                self._attempt = update.attempt
            assert self._engine is not None  # made by the first _rollout
            self._update(self._engine, sync, update)
            self._versions.append(update.version)
            wait_s, sync_s = wait_s + t1 - t0, sync_s + time.perf_counter() - t1
            if update.version >= version:
                return update, wait_s, sync_s

    @staticmethod
    def _update(engine: RolloutEngine, sync: WeightSync, update: Any) -> None:
        from tpuray.rl.weights import WeightMismatchError

        try:
            sync.release(update, engine.model_config)  # tpu_dist: checked before data moves
            engine.update_weights(update)
        except WeightMismatchError as e:
            sync.ack(update, error=str(e))  # the trainer's ranks raise it too
            raise RLRunError(
                f"the RL run ended: the trainer's update {update.version} was refused: {e}"
            ) from e
        sync.ack(update)
