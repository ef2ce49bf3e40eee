"""Reinforcement-learning substrate (issue 23): a rollout engine with weight updates, for frameworks
such as veRL, SkyRL or OpenRLHF to build on; not an RL algorithm library. See docs/rl.md.

- `RolloutConfig`, `RolloutEngine`: batched `generate(prompts, SamplingParams, n=1) -> list[Rollout]` over
  vLLM (`VLLMRolloutEngine`, where installed) or tpuray's embedded engine, in this process or tensor
  parallel on a TPU slice; `update_weights(state)` (checked before anything is written), `sleep()` /
  `wake_up()`, `shutdown()`.
- `weights`: the Hugging Face name <-> engine tensor mapping (one place); `put_shards(state, config, tp)`
  cuts an update per tensor-parallel rank where the state lives, so each engine rank receives its part.
- `sync`: weight sync from a `tpuray.train` run: `WeightSync` (driver) / `SyncTarget.send` (every trainer
  rank sends only its shard, FSDP2; rank 0 the full state, DDP) -> a `TrainerUpdate` for `update_weights`.
  Transports (`RLConfig.weight_sync`): "tpu_dist" (`collective`: a process group spanning both sides'
  workers, the data point to point; colocated, the in-process hand-over, `handover`) or "object_store"
  (ObjectRefs through the driver).
- `RLConfig`, `RLRun`: a tpuray.train trainer and a rollout engine placed by config (disaggregated, or
  colocated: the engine inside the trainer's workers, `colocate`, or vLLM there, `vllm_colocated`),
  joined by a batch -> train -> sync loop, optionally overlapped (off-policy by one step).
"""

from __future__ import annotations

from tpuray.rl import vllm_rollout  # noqa: F401  (registers RolloutEngine's vLLM subclass)
from tpuray.rl.config import RolloutConfig
from tpuray.rl.engine import Rollout, RolloutEngine, RolloutEngineError, UpdateLostError, UpdateStats
from tpuray.rl.rl_config import RLConfig
from tpuray.rl.run import IterationStats, RLResult, RLRun, RLRunError
from tpuray.rl.sync.driver import WeightSync
from tpuray.rl.sync.trainer import SyncTarget
from tpuray.rl.sync.update import SyncError, TrainerUpdate
from tpuray.rl.weights.check import WeightMismatchError
from tpuray.rl.weights.cut import ShardedUpdate, put_shards

__all__ = [
    "IterationStats",
    "RLConfig",
    "RLResult",
    "RLRun",
    "RLRunError",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutEngineError",
    "ShardedUpdate",
    "SyncError",
    "SyncTarget",
    "TrainerUpdate",
    "UpdateLostError",
    "UpdateStats",
    "WeightMismatchError",
    "WeightSync",
    "put_shards",
]
