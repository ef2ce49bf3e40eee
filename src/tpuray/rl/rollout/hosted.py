"""Colocated placement (`RLConfig(placement="colocated")`): the rollout engine runs inside the trainer's
own worker processes, on the one slice the trainer reserved (veRL's "hybrid engine").

On a TPU a chip is opened by one process, so two Ray actors (a trainer worker and an engine worker)
cannot both hold it, whatever fraction of the `TPU` resource each asks for. Here the slice is reserved
once, by `tpuray.train`, and each `TrainWorker` process is also one tensor-parallel rank of the engine:
the driver reaches it through Ray's `__ray_call__` (a `HostedGroup`), and the rank, made in that process,
is owned by the worker actor (`hosted_rank`) until the engine unloads it; the engine's collectives use the
trainer's process group. The phases take turns: the engine generates while every trainer rank waits in
`rl.batch(k)` (so no trainer collective runs), then `sleep()`s while the trainer trains, takes the update
and `wake_up()`s for the next batch. The engines: `embedded_colocated` (tpuray's embedded engine) and
`vllm_colocated` (vLLM's external launcher), both a `ColocatedEngine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tpuray.rl.config import RolloutConfig
from tpuray.rl.rollout.engine import RolloutEngine

UNLOAD_TIMEOUT_S = 10.0
ALIVE_TIMEOUT_S = 10.0
HOSTED = "tpuray_rollout_rank"  # the trainer worker actor's attribute that owns the rank it hosts

HostCall = Callable[..., Any]  # (the trainer worker actor, method, *args) -> result, run in its process


def hosted_rank(actor: Any) -> Any:
    """The rollout rank trainer worker `actor` hosts (None before the engine loads it, or once unloaded)."""
    return getattr(actor, HOSTED, None)


def host_rank(actor: Any, rank: Any) -> None:
    """Make `rank` the rollout rank trainer worker `actor` hosts (None: drop it, with its weights)."""
    setattr(actor, HOSTED, rank)


def _noop(actor: Any) -> None:
    return None


def all_alive(actors: Sequence[Any], timeout_s: float = ALIVE_TIMEOUT_S) -> bool:
    """False once one of the trainer's worker `actors` is gone (its actor died); a slow answer counts as
    alive."""
    import ray

    try:
        ray.get([a.__ray_call__.remote(_noop) for a in actors], timeout=timeout_s)
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        pass
    return True


class HostedGroup:
    """The trainer's worker actors seen as the engine's worker group (rank r = trainer rank r): what
    `EmbeddedEngine` calls on a `SliceWorkerGroup`, each call running `host_call` (a module-level
    function: pickled by reference) in the worker's process. It does not own the actors: `shutdown`
    unloads the engine from them; the trainer run stops them and releases the slice."""

    def __init__(self, actors: Sequence[Any], host_call: HostCall) -> None:
        self._actors = list(actors)
        self.host_call = host_call

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
        """False once a trainer worker is gone (`all_alive`)."""
        return all_alive(self._actors, timeout_s)

    def shutdown(self, graceful: bool = True) -> None:
        """Unload the engine from the trainer's workers (best effort: they may be gone already)."""
        import ray

        actors, self._actors = self._actors, []
        if actors and ray.is_initialized():
            refs = [a.__ray_call__.remote(self.host_call, "unload") for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=UNLOAD_TIMEOUT_S if graceful else 0)

    def __repr__(self) -> str:
        return f"HostedGroup({len(self._actors)} trainer worker(s), colocated)"


class ColocatedEngine(RolloutEngine):
    """A `RolloutEngine` whose tensor-parallel ranks are the trainer's worker processes `hosts` (their
    actor handles, rank order). Made by `tpuray.rl.rollout_engine(config, hosts)` for an `RLRun` with
    `placement="colocated"`."""

    def __init__(self, config: RolloutConfig, hosts: Sequence[Any]) -> None:
        self._hosts = list(hosts)
        super().__init__(config)

    @property
    def tensor_parallel_size(self) -> int:
        return len(self._hosts)
