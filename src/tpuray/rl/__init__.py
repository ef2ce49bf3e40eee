"""Reinforcement-learning substrate (issue 23): a rollout engine with weight updates, for frameworks
such as veRL, SkyRL or OpenRLHF to build on; not an RL algorithm library. See docs/rl.md.

- `RolloutConfig`, `RolloutEngine`: batched `generate(prompts, SamplingParams) -> list[Rollout]` over
  tpuray's embedded engine, in this process or tensor parallel on a TPU slice; `update_weights(state)`
  (checked before anything is written), `sleep()` / `wake_up()`, `shutdown()`.
- `weights`: the Hugging Face name <-> engine tensor mapping (one place); `put_shards(state, config, tp)`
  cuts an update per tensor-parallel rank where the state lives, so each engine rank receives its part.
- `sync`: weight sync from a `tpuray.train` run: `WeightSync` (driver) / `SyncTarget.send` (every trainer
  rank sends only its shard, FSDP2; rank 0 the full state, DDP) -> a `TrainerUpdate` for `update_weights`.
"""

from __future__ import annotations

from tpuray.rl.config import RolloutConfig
from tpuray.rl.engine import Rollout, RolloutEngine, RolloutEngineError, UpdateStats
from tpuray.rl.sync import SyncError, SyncTarget, TrainerUpdate, WeightSync
from tpuray.rl.weights import ShardedUpdate, WeightMismatchError, put_shards

__all__ = [
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutEngineError",
    "ShardedUpdate",
    "SyncError",
    "SyncTarget",
    "TrainerUpdate",
    "UpdateStats",
    "WeightMismatchError",
    "WeightSync",
    "put_shards",
]
