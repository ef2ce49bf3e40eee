"""The trainer's side of a weight sync: `SyncTarget`, which every rank of a `tpuray.train` run uses to
read the driver's batches and to send its part of the weights (see `tpuray.rl.sync`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tpuray.rl.sync import handover
from tpuray.rl.sync.collective import Channel, Offer, joined, member, pack
from tpuray.rl.sync.local import local
from tpuray.rl.sync.mailbox import batch_key, join_key, ready_key, resend_key, stage, weight_key
from tpuray.rl.sync.update import SyncError
from tpuray.rl.weights.check import WeightMismatchError
from tpuray.rl.weights.cut import model_state, trainer_pieces
from tpuray.rl.weights.layout import PartFn, embedded_part
from tpuray.rl.weights.vllm_layout import vllm_part

logger = logging.getLogger(__name__)


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


def generation(channel: Channel, attempt: int, engine: int) -> Channel:
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
    # process (`tpuray.rl.sync.handover`)
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
        `Handed` marker for it in the mailbox (`tpuray.rl.sync.handover`). Returns bytes per rollout rank."""
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
            packed = [pack(p, local().send_buffers, (*where, q)) for q, p in enumerate(pieces)]
            offers = [Offer(rank, m, f.numel()) if f is not None else None for m, f in packed]
            sent = _Sent(version, offers, nbytes, [f for _, f in packed], engine=-1)
            local().last_sent[(self.channel.host, self.channel.port)] = sent
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
        channel = generation(self.channel, attempt, sent.engine)
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
            sent = local().last_sent.get((self.channel.host, self.channel.port))
            if sent is None or sent.engine >= value:
                continue  # nothing sent yet, or it went to this engine already
            self._offer(sent, attempt, rank)
            ack = weight_key(attempt, "ack", sent.version, rank)
            if ack != key:
                error = self._wait(ack, attempt, rank)
                if error is not None:
                    raise WeightMismatchError(error)
