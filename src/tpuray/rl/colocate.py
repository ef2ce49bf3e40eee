"""Colocated placement (`RLConfig(placement="colocated")`): the rollout engine runs inside the trainer's
own worker processes, on the one slice the trainer reserved (veRL's "hybrid engine").

On a TPU a chip is opened by one process, so two Ray actors (a trainer worker and an engine worker)
cannot both hold it, whatever fraction of the `TPU` resource each asks for. Here the slice is reserved
once, by `tpuray.train`, and each `TrainWorker` process is also one tensor-parallel rank of the
embedded engine: the driver reaches it through Ray's `__ray_call__` (a `RolloutWorker` kept in that
process), and the engine's collectives use the trainer's process group. The phases take turns: the
engine generates while every trainer rank waits in `rl.batch(k)` (so no trainer collective runs),
then `sleep()`s (its KV cache freed; its weights copied to host memory at level 1, discarded at level 2)
while the trainer trains, takes the update (over "tpu_dist" the shards its trainer rank handed over in
this process, adopted at `wake_up()` without a copy) and `wake_up()`s for the next batch. A vLLM engine
colocated the same way: `tpuray.rl.vllm_colocated` (its ranks are these workers too, through a
HostedGroup).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tpuray.rl.config import RolloutConfig
from tpuray.rl.engine import RolloutEngine, _RolloutEmbeddedEngine
from tpuray.rl.protocol import GenerationEngine
from tpuray.rl.worker import RolloutWorker
from tpuray.serve.llm import model_source

logger = logging.getLogger(__name__)
UNLOAD_TIMEOUT_S = 10.0
ALIVE_TIMEOUT_S = 10.0

_hosted: RolloutWorker | None = None  # in a trainer worker's process: its rollout rank


def _on_host(actor: Any, method: str, *args: Any) -> Any:
    """Runs in a trainer worker (through `__ray_call__`): `method` of this process's rollout rank."""
    global _hosted
    if method == "unload":
        _hosted = None  # drops the engine's weights and KV cache with the runner
        return None
    if _hosted is None:
        _hosted = RolloutWorker()
    return getattr(_hosted, method)(*args)


def _noop(actor: Any) -> None:
    return None


class HostedGroup:
    """The trainer's worker actors seen as the engine's worker group (rank r = trainer rank r): what
    `EmbeddedEngine` calls on a `SliceWorkerGroup`. It does not own the actors: `shutdown` unloads the
    engine from them; the trainer run stops them and releases the slice."""

    host_call = staticmethod(_on_host)  # what each call runs in a trainer worker (module-level: pickled)

    def __init__(self, actors: Sequence[Any]) -> None:
        self._actors = list(actors)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    @property
    def world_size(self) -> int:
        return len(self._actors)

    def call(self, method: str, *args: Any) -> list[Any]:
        return [a.__ray_call__.remote(self.host_call, method, *args) for a in self._actors]

    def call_each(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]:
        if len(args_per_rank) != len(self._actors):
            raise ValueError(f"args_per_rank has {len(args_per_rank)} entries for {len(self._actors)} ranks")
        return [
            a.__ray_call__.remote(self.host_call, method, *args)
            for a, args in zip(self._actors, args_per_rank, strict=True)
        ]

    def node_ids(self) -> list[str]:
        return []

    def all_alive(self, timeout_s: float = ALIVE_TIMEOUT_S) -> bool:
        """False once a trainer worker is gone (its actor died); a slow answer counts as alive."""
        import ray

        try:
            ray.get([a.__ray_call__.remote(_noop) for a in self._actors], timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return False
        except ray.exceptions.GetTimeoutError:
            pass
        return True

    def shutdown(self, graceful: bool = True) -> None:
        """Unload the engine from the trainer's workers (best effort: they may be gone already)."""
        import ray

        actors, self._actors = self._actors, []
        if actors and ray.is_initialized():
            refs = [a.__ray_call__.remote(self.host_call, "unload") for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=UNLOAD_TIMEOUT_S if graceful else 0)

    def __repr__(self) -> str:
        return f"HostedGroup({len(self._actors)} trainer worker(s), colocated)"


class _HostedEmbeddedEngine(_RolloutEmbeddedEngine):
    """The embedded engine whose ranks are a trainer's workers (no reservation, no process group of
    its own)."""

    def __init__(self, config: RolloutConfig, hosts: Sequence[Any]) -> None:
        self._hosts = list(hosts)
        super().__init__(config.llm_config, use_actors=True)

    def _start_workers(self, source: str, kwargs: dict, timeout_s: float) -> None:
        import ray

        group = HostedGroup(self._hosts)
        self.group = group  # type: ignore[assignment]  # duck-typed SliceWorkerGroup
        # the trainer's hosts read the model from the same path (a local dir on shared or copied storage)
        self.worker_info = ray.get(group.call("load", model_source.resolve(source), kwargs))
        logger.info("rollout engine colocated with the trainer: tensor_parallel_size=%d", group.world_size)


class ColocatedRolloutEngine(RolloutEngine):
    """A `RolloutEngine` (embedded) whose tensor-parallel ranks are the trainer's worker processes,
    `hosts` (their actor handles, rank order). Made by `RLRun` for `placement="colocated"`."""

    def __init__(self, config: RolloutConfig, hosts: Sequence[Any]) -> None:
        self._hosts = list(hosts)
        super().__init__(config)

    def _start_engine(self, config: RolloutConfig) -> GenerationEngine:
        return _HostedEmbeddedEngine(config, self._hosts)

    @property
    def tensor_parallel_size(self) -> int:
        return len(self._hosts)
