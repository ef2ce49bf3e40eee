"""The driver's side of a weight sync (`WeightSync`): the mailbox actor the trainer's ranks and the
driver meet at, the tpu_dist rendezvous, and the updates the driver takes from the ranks and hands to the
rollout engine (see `tpuray.rl.sync`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tpuray.rl.config import TRANSPORTS, Transport
from tpuray.rl.sync.collective import Rendezvous
from tpuray.rl.sync.mailbox import Mailbox, join_key, weight_key
from tpuray.rl.sync.trainer import SyncTarget, generation
from tpuray.rl.sync.update import TrainerUpdate

POLL_S = 0.5


def on_this_node() -> Any:
    """A scheduling strategy that keeps a driver-side helper actor (no CPU) on the driver's own node: a
    TPU host may be lost or preempted under the run, and the helper must outlive it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


class WeightSync:
    """The driver's end of the sync between a trainer run of `trainer_world_size` ranks and a rollout
    engine of `tensor_parallel_size` ranks: a mailbox actor (no CPU) that ObjectRefs pass through."""

    def __init__(
        self,
        tensor_parallel_size: int,
        trainer_world_size: int,
        timeout_s: float = 600.0,
        transport: Transport = "object_store",
        vllm_config: Mapping[str, Any] | None = None,
        colocated: bool = False,
        model_config: Mapping[str, Any] | None = None,
    ) -> None:
        """`colocated`: the engine runs in the trainer's workers (an RLRun's colocated placement): over
        "object_store" the mailbox owns each rank's pieces; over "tpu_dist" each rank hands the engine's
        rank in its process its part (`tpuray.rl.sync.handover`), cut by `model_config` (the engine's
        config.json; in vLLM's layout where `vllm_config` is given too)."""
        import ray

        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is invalid; valid: {', '.join(TRANSPORTS)}")
        in_process = colocated and transport == "tpu_dist"
        if in_process and model_config is None:
            raise ValueError(
                "a colocated weight sync over 'tpu_dist' hands each engine rank its part in process: it "
                "needs the engine's model_config (config.json)"
            )
        self.world_size = trainer_world_size
        self.formed: set[tuple[int, int]] = set()  # tpu_dist: (trainer attempt, engine) groups told to form
        self._pending_update: Any = None  # the mailbox's take_update call, while no update came of it
        self.rendezvous = (
            Rendezvous(trainer_world_size, tensor_parallel_size, timeout_s)
            if transport == "tpu_dist" and not colocated
            else None
        )
        self.mailbox = (
            ray.remote(num_cpus=0)(Mailbox)
            .options(max_concurrency=1000, scheduling_strategy=on_this_node())
            .remote(trainer_world_size)
        )
        channel = self.rendezvous.channel if self.rendezvous is not None else None
        self.target = SyncTarget(
            self.mailbox,
            tensor_parallel_size,
            timeout_s,
            channel=channel,
            colocated=colocated,
            vllm_config=vllm_config,
            handover_config=model_config if in_process else None,
        )

    def put_all(self, items: Mapping[str, Any]) -> None:
        """Put each key's value in the mailbox (one actor call)."""
        import ray

        ray.get(self.mailbox.put_all.remote(items))

    def batches_held(self) -> int:
        """How many batches the mailbox holds for a trainer restart (`Mailbox.release_batches`)."""
        import ray

        return int(ray.get(self.mailbox.batches_held.remote()))

    def receive(self, alive: Callable[[], None] = lambda: None) -> TrainerUpdate:
        """Wait for the next update every rank of the newest trainer attempt sent (its `version`: the
        next one, or after a trainer restart one the engine may already hold); `alive()` is called while
        waiting and raises when the trainer run ended (so a dead trainer does not hang the driver)."""
        import ray

        pending = self._update_call()
        while not ray.wait([pending], timeout=POLL_S)[0]:
            alive()
        return self._taken(pending)

    def _update_call(self) -> Any:
        """The mailbox's `take_update` call: the one outstanding, else a new one."""
        if self._pending_update is None:
            self._pending_update = self.mailbox.take_update.remote()
        return self._pending_update

    def _taken(self, pending: Any) -> TrainerUpdate:
        import ray

        self._pending_update = None
        attempt, engine, version, sent_by_rank = ray.get(pending)
        tp = self.target.tensor_parallel_size
        refs: list[list[Any]] = [[] for _ in range(tp)]
        nbytes = [0] * tp
        for sent, sizes in sent_by_rank:
            for r in range(tp):
                if sent[r] is not None:
                    refs[r].append(sent[r])
                    nbytes[r] += sizes[r]
        channel = self.target.channel
        if channel is not None:
            channel = generation(channel, attempt, engine)
            if (attempt, engine) not in self.formed:  # the ranks form the group once its engine joins
                self.formed.add((attempt, engine))
                self.put_all({join_key(attempt, engine, r): None for r in range(self.world_size)})
        return TrainerUpdate(tuple(tuple(r) for r in refs), tuple(nbytes), channel, version, attempt)

    def replace_engine(self) -> None:
        """A new rollout engine replaced a failed one. Over tpu_dist it forms a new group with the
        trainer's ranks, and each rank sends its last update again into it (`receive` it next), also
        one whose transfer failed with the old engine. Nothing to do over the object store (the driver
        holds the last update's ObjectRefs)."""
        import ray

        if self.target.channel is not None:
            ray.get(self.mailbox.replace_engine.remote())

    def ready(
        self,
        k: int,
        alive: Callable[[], None] = lambda: None,
        on_update: Callable[[TrainerUpdate], object] = lambda update: None,
    ) -> tuple[int, list[Any]]:
        """Colocated: wait until every rank of the newest trainer attempt waits for batch `k`: (that
        attempt, the ranks' actor handles in rank order). Updates arriving meanwhile (a restarted
        trainer re-sending the versions after its checkpoint) go to `on_update`."""
        import ray

        pending = self.mailbox.take_ready.remote(k)
        while True:
            update = self._update_call()
            done, _ = ray.wait([pending, update], num_returns=1, timeout=POLL_S)
            if pending in done:
                return tuple(ray.get(pending))
            if update in done:
                on_update(self._taken(update))
            else:
                alive()

    def ack(self, update: TrainerUpdate, error: str | None = None) -> None:
        """Tell every trainer rank that `update` was committed (or refused, with `error`)."""
        acks = {weight_key(update.attempt, "ack", update.version, r): error for r in range(self.world_size)}
        self.put_all(acks)

    def shutdown(self) -> None:
        """Kill the mailbox: a trainer rank waiting on it gets SyncError (its run ends)."""
        import ray

        ray.kill(self.mailbox, no_restart=True)
        if self.rendezvous is not None:
            self.rendezvous.close()
