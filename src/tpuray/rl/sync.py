"""Weight sync straight from a `tpuray.train` run into a `RolloutEngine`'s workers (issue 23, item 2).

Every trainer rank cuts, from the tensors it holds, the part each rollout tensor-parallel rank needs
(`tpuray.rl.weights.cut`).
Transport "object_store": it puts one object per rollout rank in Ray's object store; only the ObjectRefs
travel through a small mailbox actor to the driver, which hands them to the engine: rollout rank r pulls
the pieces addressed to it from every trainer rank, checks and assembles them, and stages its fused
shards (the engine's all-or-nothing stage / commit). Transport "tpu_dist" (`tpuray.rl.collective`): only
the pieces' metadata travels through the mailbox; the trainer ranks send the data at once over a process
group spanning both sides, and rollout rank r receives it when the driver hands it the metadata, then
checks, assembles and stages as above. No full copy of the state on the driver. Colocated over
"tpu_dist" (the engine's ranks are the trainer's processes), each rank builds its own engine rank's
shards over the trainer's group and leaves them in its process (`tpuray.rl.handover`): only a marker
passes the mailbox.

- sharded trainer (FSDP2 / DTensor with `Shard(0)` on a 1-D mesh): every rank sends the rows it holds;
- replicated trainer (DDP, or one worker): rank 0 sends the full state, the other ranks nothing.

On the trainer (in the train loop):      `target.send(model, version)`  (every rank; blocks until the
                                          engine committed the update, so the objects' owner outlives it)
On the driver:                            `sync = WeightSync(tp, trainer_world_size, transport=...)`,
                                          `update = sync.receive(alive)` (its `version`),
                                          `engine.update_weights(update)`, `sync.ack(update)`
                                          (or `sync.ack(update, error)` when it was refused).

Trainer restarts (`tpuray.train` fault tolerance, docs/rl.md "Trainer restarts"): the weight keys carry the
trainer attempt (`TrainContext.get_attempt()`); the mailbox forgets an older attempt's entries once a
newer one sends, `receive` returns the newest attempt's first complete update (a restarted trainer
re-sends the versions after its checkpoint), and batches stay in the mailbox so that a restarted rank
can take batch k again. Over "tpu_dist" each attempt forms its own group with the engine's workers
(`Channel.generation`). Colocated, a rank says where it waits (`ready` keys, with its actor handle, where
the next engine starts after a restart); over "object_store" its pieces are handed to the mailbox,
which owns them (`Mailbox.hand_over`): the last update outlives a lost attempt; over "tpu_dist" the
update lives only in its senders' processes (`tpuray.rl.handover`).

Rollout restarts (docs/rl.md "Rollout restarts"): over "object_store" the driver reloads the last
update's ObjectRefs into the new engine. Over "tpu_dist" the new engine is a new incarnation
(`Channel.engine`, its own group) and `WeightSync.replace_engine` asks every rank to send its last update
(kept in `_LAST_SENT`) again into it; the rank does so wherever it waits (`SyncTarget._wait`, and
before its group formed, `_offer`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from tpuray.rl import handover
from tpuray.rl.collective import Channel, Offer, Rendezvous, joined, member, pack
from tpuray.rl.mailbox import Mailbox, batch_key, join_key, ready_key, resend_key, stage, weight_key
from tpuray.rl.weights.buffers import BufferPool
from tpuray.rl.weights.check import WeightMismatchError
from tpuray.rl.weights.cut import model_state, trainer_pieces
from tpuray.rl.weights.layout import PartFn, Piece, embedded_part
from tpuray.rl.weights.vllm_layout import vllm_part

Transport = Literal["object_store", "tpu_dist"]  # RLConfig.weight_sync documents each
TRANSPORTS: tuple[str, ...] = get_args(Transport)
POLL_S = 0.5
logger = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """The other side of a weight sync went away (the trainer run or the driver ended)."""


@dataclass(frozen=True)
class TrainerUpdate:
    """A weight update sent by the ranks of a trainer: `refs[r]` are what rollout rank r receives from
    each trainer rank that holds some of its part: the ObjectRefs of the pieces (weight_sync
    "object_store"), or `Offer`s (trainer rank, the pieces' metadata, bytes) whose data comes over
    `channel`'s process group ("tpu_dist", `tpuray.rl.collective`). Pass it to
    `RolloutEngine.update_weights`."""

    refs: tuple[tuple[Any, ...], ...]
    nbytes: tuple[int, ...]  # bytes each rollout rank receives
    channel: Channel | None = None  # tpu_dist: where the group meets; None: through the object store
    version: int = 0  # the weight version the trainer sent
    attempt: int = 0  # the tpuray.train attempt whose ranks sent it (0, then +1 per trainer restart)

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.refs)


# -- the trainer's side ---------------------------------------------------------------------------------
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _attempt() -> int:
    """This tpuray.train worker's attempt (0 outside a tpuray.train run)."""
    from tpuray.train.session import current_session

    session = current_session()
    return session.context.attempt if session is not None else 0


def _reports_made() -> int | None:
    """How many reports (`tpuray.train.report`) this tpuray.train worker's run has made, counting those of
    the attempts it resumed from (None outside a tpuray.train run)."""
    from tpuray.train.session import current_session

    session = current_session()
    return session.next_index if session is not None else None


def _generation(channel: Channel, attempt: int, engine: int) -> Channel:
    """The tpu_dist group of trainer attempt `attempt` and rollout engine incarnation `engine` (each
    attempt's new processes, and each replaced engine, form their own)."""
    return dataclasses.replace(channel, generation=attempt, engine=engine)


@dataclass
class _Sent:
    """A trainer rank's last update over tpu_dist, kept to send it again into a replaced engine."""

    version: int
    offers: list[Offer | None]
    nbytes: list[int]
    flats: list[torch.Tensor | None]
    engine: int  # the engine incarnation it went to


_LAST_SENT: dict[tuple[str, int], _Sent] = {}  # this process's, by rendezvous address
_SEND_BUFFERS = BufferPool()  # this process's packed updates, by rendezvous address and rollout rank


@dataclass(frozen=True)
class SyncTarget:
    """What a train loop needs to send weights to the rollout engine (picklable: put it in
    `train_loop_config`). Made by `WeightSync.target`."""

    mailbox: Any  # the _Mailbox actor
    tensor_parallel_size: int
    timeout_s: float
    iterations: int = 0  # of an RLRun: how many batches the driver sends
    channel: Channel | None = None  # weight_sync "tpu_dist": the group's rendezvous; None: object store
    colocated: bool = False  # of an RLRun: the rollout engine runs in the trainer's workers
    vllm_config: Mapping[str, Any] | None = None  # the engine is vLLM: pieces cut in its layout (config.json)
    # colocated over "tpu_dist": the engine's config.json; each rank hands its engine rank its shards in
    # process (`tpuray.rl.handover`)
    handover_config: Mapping[str, Any] | None = None

    @property
    def part(self) -> PartFn:
        """How a rollout rank's part of a tensor is cut: the embedded engine's layout, or vLLM's."""
        if self.vllm_config is None:
            return embedded_part
        return functools.partial(vllm_part, config=self.vllm_config)

    def batch(self, k: int) -> Any:
        """Batch k of an `RLRun` (what its rollout_fn returned), once the driver has it. Colocated, the
        rank first says it waits here (with its actor handle, where the engine runs): the driver
        generates only while every rank waits, so the engine's collectives never meet the trainer's."""
        import ray

        rank, attempt = _rank(), _attempt()
        if self.colocated:
            me = ray.get_runtime_context().current_actor
            ray.get(self.mailbox.put.remote(ready_key(attempt, k, rank), me))
        reports = _reports_made()
        if reports is not None:  # the mailbox may drop batch k once a checkpoint reported after it commits
            self.mailbox.reading_batch.remote(k, reports)
        # read, not taken: a restarted trainer takes the batches after its checkpoint again
        ref = self._wait(batch_key(k, rank), attempt, rank, keep=True)
        return ray.get(ref[0])

    def send(self, model: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> int:
        """Send this rank's part of the model's weights as update `version` and wait until the engine
        committed it (or refused it: WeightMismatchError). Call on every trainer rank. Returns bytes sent."""

        rank, attempt = _rank(), _attempt()
        key = weight_key(attempt, "weights", version, rank)
        if self.handover_config is not None:  # colocated over tpu_dist: in this process, on the device
            nbytes = self._hand_over(model, key, rank)
        else:
            nbytes = self._send_pieces(model, key, rank, attempt, version)
        error = self._wait(weight_key(attempt, "ack", version, rank), attempt, rank)
        if error is not None:
            raise WeightMismatchError(error)
        return sum(nbytes)

    def _hand_over(
        self, model: torch.nn.Module | Mapping[str, torch.Tensor], key: str, rank: int
    ) -> list[int]:
        """Colocated over tpu_dist: leave this rank's engine rank its shards in this process and put a
        `Handed` marker for it in the mailbox (`tpuray.rl.handover`). Returns bytes per rollout rank."""
        import ray

        assert self.handover_config is not None
        tp, state, config = self.tensor_parallel_size, model_state(model), self.handover_config
        if self.vllm_config is None:  # the embedded engine's fused shards, adopted as they are
            tensors = handover.rank_shards(state, rank, tp, config)
            handover.keep(key, tensors)
        else:  # vLLM's part of each tensor, joined by its worker
            pieces = handover.rank_pieces(state, rank, tp, config, self.part)
            handover.keep(key, pieces)
            tensors = {name: t for name, (_, t) in pieces.items()}
        nbytes = [0] * tp
        nbytes[rank] = sum(t.numel() * t.element_size() for t in tensors.values())
        markers = [handover.Handed(key) if r == rank else None for r in range(tp)]
        ray.get(self.mailbox.put.remote(key, (markers, nbytes)))
        return nbytes

    def _send_pieces(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        key: str,
        rank: int,
        attempt: int,
        version: int,
    ) -> list[int]:
        """Cut this rank's pieces for every rollout rank and send them (object store, or tpu_dist's
        group); colocated, hand them to the mailbox, which owns them. Returns bytes per rollout rank."""
        import ray

        packed_later = self.channel is not None and not self.colocated  # tpu_dist: pack copies them
        pieces = trainer_pieces(
            model_state(model), rank, self.tensor_parallel_size, self.part, compact=not packed_later
        )
        nbytes = [sum(t.numel() * t.element_size() for _, t in p.values()) for p in pieces]
        if self.colocated:  # owned by the mailbox: the next engine may load them after this rank is gone
            if any(pieces):
                stage(key, [p for p in pieces if p])
            me = ray.get_runtime_context().current_actor
            ray.get(self.mailbox.hand_over.remote(key, me, [bool(p) for p in pieces], nbytes))
        elif self.channel is None:
            refs = [ray.put(p) if p else None for p in pieces]
            ray.get(self.mailbox.put.remote(key, (refs, nbytes)))
        else:  # only the metadata goes through the mailbox; the data straight to the rollout ranks
            where = (self.channel.host, self.channel.port)  # reused: the last update was acked
            packed = [pack(p, _SEND_BUFFERS, (*where, q)) for q, p in enumerate(pieces)]
            offers = [Offer(rank, m, f.numel()) if f is not None else None for m, f in packed]
            sent = _Sent(version, offers, nbytes, [f for _, f in packed], engine=-1)
            _LAST_SENT[(self.channel.host, self.channel.port)] = sent
            self._offer(sent, attempt, rank)
        return nbytes

    def _offer(self, sent: _Sent, attempt: int, rank: int) -> None:
        """tpu_dist: put the update's metadata in the mailbox, then send its data into the group of the
        engine incarnation the mailbox names. A group forms once, when the driver says its engine joins
        (a rollout worker lost before would leave the group waiting): meanwhile a replaced engine
        redirects the offer. A failed transfer (a rollout worker lost) is left to the driver: it
        replaces the engine and asks again (`_wait`), or ends the run (SyncError there)."""
        import ray

        assert self.channel is not None
        key = weight_key(attempt, "weights", sent.version, rank)
        sent.engine = ray.get(self.mailbox.put.remote(key, (sent.offers, sent.nbytes)))
        channel = _generation(self.channel, attempt, sent.engine)
        if not joined(channel, rank):
            join, resend = join_key(attempt, sent.engine, rank), resend_key(attempt, rank)
            while True:
                got, value = self._first([resend, join], None, join)
                if got == join:
                    break
                if value > sent.engine:  # replaced before it joined: offer to the new one instead
                    return self._offer(sent, attempt, rank)
        try:
            member(channel, rank).send_all(sent.flats)
        except Exception as e:  # noqa: BLE001 - the driver decides: resend into a new engine, or the end
            logger.warning(
                "tpuray.rl: sending update %d failed (%s); waiting for the driver", sent.version, e
            )

    def _first(self, keys: list[str], keep: str | None, waiting_for: str) -> tuple[str, Any]:
        import ray

        try:
            return ray.get(self.mailbox.first.remote(keys, keep, self.timeout_s))
        except ray.exceptions.RayActorError as e:
            raise SyncError(
                f"the RL run's mailbox is gone while waiting for {waiting_for!r}: the run ended"
            ) from e

    def _wait(self, key: str, attempt: int, rank: int, keep: bool = False) -> Any:
        """The value under `key` (taken; `keep`: read). Over tpu_dist, while waiting, send the last
        update again whenever the driver replaced the engine since it went (and wait for its ack)."""
        resend = resend_key(attempt, rank) if self.channel is not None else None
        keys = [key] if resend is None else [resend, key]
        while True:
            got, value = self._first(keys, key if keep else None, key)
            if got == key:
                return value
            assert self.channel is not None
            sent = _LAST_SENT.get((self.channel.host, self.channel.port))
            if sent is None or sent.engine >= value:
                continue  # nothing sent yet, or it went to this engine already
            self._offer(sent, attempt, rank)
            ack = weight_key(attempt, "ack", sent.version, rank)
            if ack != key:
                error = self._wait(ack, attempt, rank)
                if error is not None:
                    raise WeightMismatchError(error)


# -- the rollout rank's side ----------------------------------------------------------------------------
def resolve_pieces(refs: Any, channel: Channel | None = None, rank: int = 0) -> list[dict[str, Piece]]:
    """The pieces addressed to rollout rank `rank`: pulled from the object store, or received over the
    tpu_dist group (`channel`) from the trainer ranks that offered them."""
    import ray

    if handover.is_handed(refs):  # colocated over tpu_dist: left in this process by its trainer rank
        return [handover.take(list(refs))]
    if channel is None:
        return list(ray.get([r for r in refs if r is not None]))
    return member(channel, channel.rollout_rank(rank)).recv_all(list(refs))


# -- the driver's side ----------------------------------------------------------------------------------
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
        rank in its process its part (`tpuray.rl.handover`), cut by `model_config` (the engine's
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
            channel = _generation(channel, attempt, engine)
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
