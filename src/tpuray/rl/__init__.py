"""Reinforcement-learning substrate (issue 23): a rollout engine with weight updates, for frameworks
such as veRL, SkyRL or OpenRLHF to build on; not an RL algorithm library. See docs/rl.md.

- `RolloutConfig`, `rollout_engine(config) -> RolloutEngine`: batched `generate(prompts, SamplingParams,
  n=1) -> list[Rollout]` over vLLM or tpuray's embedded engine, in this process or tensor parallel on a
  TPU slice; `update_weights(state)` (checked before anything is written), `sleep()` / `wake_up()`,
  `shutdown()` (`tpuray.rl.rollout`).
- `put_shards(state, config, tp)`: an update cut per tensor-parallel rank where the state lives
  (`tpuray.rl.weights`: the Hugging Face name <-> engine tensor mapping, in one place).
- Weight sync from a `tpuray.train` run (`tpuray.rl.sync`): `WeightSync` (driver) / `SyncTarget.send`
  (every trainer rank sends only its shard) -> a `TrainerUpdate` for `update_weights`, over
  `RLConfig.weight_sync` "tpu_dist" or "object_store".
- `RLConfig`, `RLRun`: a tpuray.train trainer and a rollout engine placed by config (disaggregated, or
  colocated in the trainer's workers), joined by a batch -> train -> sync loop, optionally overlapped.
"""

from __future__ import annotations

from tpuray.rl.config import RLConfig, RolloutConfig
from tpuray.rl.rollout.engine import Rollout, RolloutEngine, RolloutEngineError, UpdateLostError, UpdateStats
from tpuray.rl.rollout.factory import rollout_engine
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
    "rollout_engine",
]
