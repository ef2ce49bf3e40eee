"""`EmbeddedRolloutEngine`: the rollout engine over tpuray's embedded engine (`EmbeddedEngine`: continuous
batching, tensor parallel over a slice's chips), driven directly: in this process on the CPU (its
`ModelRunner`'s weights through `RunnerWeights`), or on a TPU slice it reserves atomically like a serving
replica (a `SliceWorkerGroup` of `RolloutWorker`s, one per chip share: `embedded_worker`). `shutdown()`
stops the workers and releases the slice (also on a failed start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpuray.rl.config import RolloutConfig
from tpuray.rl.rollout.embedded_worker import RolloutWorker, RunnerWeights
from tpuray.rl.rollout.engine import RolloutEngine, host_state, lost_update
from tpuray.rl.rollout.protocol import GenerationEngine
from tpuray.rl.sync.collective import TransferError
from tpuray.rl.sync.update import TrainerUpdate
from tpuray.rl.weights.check import WeightMismatchError
from tpuray.rl.weights.cut import ShardedUpdate
from tpuray.serve.llm import model_source
from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine


class _RolloutEmbeddedEngine(EmbeddedEngine):
    """EmbeddedEngine whose slice workers are `RolloutWorker`s (same start-up as EmbeddedEngine's)."""

    worker_cls = RolloutWorker


class EmbeddedRolloutEngine(RolloutEngine):
    """`RolloutEngine` over tpuray's embedded engine (see the module docstring)."""

    def __init__(self, config: RolloutConfig) -> None:
        self._local: RunnerWeights | None = None  # the in-process runner's weights (no slice)
        super().__init__(config)
        if self._engine.runner is not None:
            path = Path(model_source.resolve(config.model_source))
            self._local = RunnerWeights(self._engine.runner, path, rank=0, world_size=1)

    def _start_engine(self, config: RolloutConfig) -> GenerationEngine:
        return _RolloutEmbeddedEngine(
            config.llm_config, use_actors=config.on_slice, reservation_timeout_s=config.reservation_timeout_s
        )

    def _check_update(self, update: Any) -> None:
        super()._check_update(update)
        if isinstance(update, TrainerUpdate) and update.channel is not None and self._local is not None:
            raise ValueError(
                "a TrainerUpdate over weight_sync='tpu_dist' needs the engine's workers on a slice "
                "(RolloutConfig accelerator_type and topology); valid here: weight_sync='object_store'"
            )

    def _load_update(self, update: Any) -> int:
        if self._local is None:
            return super()._load_update(update)
        try:
            if isinstance(update, ShardedUpdate):
                self._local.stage_shards(update.refs[0])
            elif isinstance(update, TrainerUpdate):
                self._local.stage_pieces(update.refs[0])
            else:
                self._local.stage(update)
            return self._local.commit()
        finally:
            self._local.discard()

    def _update_workers(self, update: Any) -> int:
        return update_group(self._engine.group, update, self.version)

    def _on_ranks(self, method: str, *args: Any) -> int:
        if self._local is not None:
            return int(getattr(self._local, method)(*args))
        return super()._on_ranks(method, *args)

    def shutdown(self) -> None:
        self._local = None  # drops the in-process runner's weights with the engine
        super().shutdown()


def update_group(group: Any, update: Any, version: int) -> int:
    """Stage `update` on every rank of `group` (`RolloutWorker`s, on a slice or in a trainer's workers),
    then commit it; the bytes written. A refusal discards what the ranks staged: WeightMismatchError, or
    UpdateLostError where the pieces were lost with their sender (the engine held weight `version`)."""
    import ray

    if group is None:
        raise RuntimeError("RolloutEngine.update_weights after shutdown()")
    try:
        if isinstance(update, ShardedUpdate):  # rank r pulls only refs[r]
            ray.get(group.call_each("stage_shards", [(ref,) for ref in update.refs]))
        elif isinstance(update, TrainerUpdate):  # rank r pulls the pieces addressed to it
            args = [(list(refs), update.channel) for refs in update.refs]
            ray.get(group.call_each("stage_pieces", args))
        else:
            ref = update if isinstance(update, ray.ObjectRef) else ray.put(host_state(update))
            ray.get(group.call("stage_weights", ref))
    except ray.exceptions.RayTaskError as e:
        ray.get(group.call("discard_weights"))
        cause = getattr(e, "cause", None)
        if isinstance(cause, WeightMismatchError):
            raise WeightMismatchError(str(cause)) from None
        if isinstance(cause, ray.exceptions.ObjectLostError | TransferError):
            raise lost_update(version, f"{type(cause).__name__}: {cause}") from None
        raise
    return sum(ray.get(group.call("commit_weights")))
