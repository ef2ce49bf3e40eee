"""`rollout_engine(config, hosts=None)`: the rollout engine a `RolloutConfig` names, made explicitly:
`config.resolved_engine` ("embedded" or "vllm") picks the kind; `hosts` (a colocated `RLRun`'s trainer
workers) runs it in those processes instead of workers of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpuray.rl.config import RolloutConfig
from tpuray.rl.rollout.embedded import EmbeddedRolloutEngine
from tpuray.rl.rollout.embedded_colocated import ColocatedEmbeddedEngine
from tpuray.rl.rollout.engine import RolloutEngine
from tpuray.rl.rollout.vllm import VLLMRolloutEngine
from tpuray.rl.rollout.vllm_colocated import ColocatedVLLMEngine

ENGINES: dict[str, type[RolloutEngine]] = {"embedded": EmbeddedRolloutEngine, "vllm": VLLMRolloutEngine}
COLOCATED: dict[str, type[ColocatedEmbeddedEngine | ColocatedVLLMEngine]] = {
    "embedded": ColocatedEmbeddedEngine,
    "vllm": ColocatedVLLMEngine,
}


def rollout_engine(config: RolloutConfig, hosts: Sequence[Any] | None = None) -> RolloutEngine:
    """Start the rollout engine `config` names (`config.resolved_engine`: tpuray's embedded engine or
    vLLM), in this process or on the slice `config` names; with `hosts` (the actor handles of a trainer's
    workers, in rank order), inside those processes, one tensor-parallel rank each (`RLRun`'s
    `placement="colocated"`). `shutdown()` it (or use `with`) to release what it holds."""
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"config must be a RolloutConfig, got {type(config).__name__}")
    if hosts is None:
        return ENGINES[config.resolved_engine](config)
    return COLOCATED[config.resolved_engine](config, hosts)
