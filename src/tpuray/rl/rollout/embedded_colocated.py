"""`ColocatedEmbeddedEngine`: tpuray's embedded engine colocated with a trainer (`hosted`): each trainer
worker process is one tensor-parallel rank, a `RolloutWorker` it owns. The engine generates while every
trainer rank waits for its batch, then `sleep()`s (its KV cache freed; its weights copied to host memory
at level 1, discarded at level 2) while the trainer trains, takes the update (over "tpu_dist" the shards
its trainer rank handed over in this process, adopted at `wake_up()` without a copy) and wakes up for the
next batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tpuray.rl.config import RolloutConfig
from tpuray.rl.rollout.embedded import _RolloutEmbeddedEngine, update_group
from tpuray.rl.rollout.embedded_worker import RolloutWorker
from tpuray.rl.rollout.hosted import ColocatedEngine, HostedGroup, host_rank, hosted_rank
from tpuray.rl.rollout.protocol import GenerationEngine
from tpuray.serve.llm import model_source

logger = logging.getLogger(__name__)


def _on_host(actor: Any, method: str, *args: Any) -> Any:
    """Runs in a trainer worker (through `__ray_call__`): `method` of the `RolloutWorker` the worker hosts
    (made at the first call; "unload" drops it, and the engine's weights and KV cache with it)."""
    if method == "unload":
        host_rank(actor, None)
        return None
    if hosted_rank(actor) is None:
        host_rank(actor, RolloutWorker())
    return getattr(hosted_rank(actor), method)(*args)


class _HostedEmbeddedEngine(_RolloutEmbeddedEngine):
    """The embedded engine whose ranks are a trainer's workers (no reservation, no process group of
    its own)."""

    def __init__(self, config: RolloutConfig, hosts: Sequence[Any]) -> None:
        self._hosts = list(hosts)
        super().__init__(config.llm_config, use_actors=True)

    def _start_workers(self, source: str, kwargs: dict, timeout_s: float) -> None:
        import ray

        group = HostedGroup(self._hosts, _on_host)
        self.group = group  # type: ignore[assignment]  # duck-typed SliceWorkerGroup
        # the trainer's hosts read the model from the same path (a local dir on shared or copied storage)
        self.worker_info = ray.get(group.call("load", model_source.resolve(source), kwargs))
        logger.info("rollout engine colocated with the trainer: tensor_parallel_size=%d", group.world_size)


class ColocatedEmbeddedEngine(ColocatedEngine):
    """A `RolloutEngine` over the embedded engine whose tensor-parallel ranks are the trainer's worker
    processes (see the module docstring)."""

    def _start_engine(self, config: RolloutConfig) -> GenerationEngine:
        return _HostedEmbeddedEngine(config, self._hosts)

    def _update_workers(self, update: Any) -> int:
        return update_group(self._engine.group, update, self.version)
