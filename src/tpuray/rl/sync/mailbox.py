"""The RL run's mailbox: a small async Ray actor (no CPU) through which the driver and the trainer's ranks
exchange batches, weight-update metadata (ObjectRefs or tpu_dist offers) and acknowledgements
(`tpuray.rl.sync`). Values may hold ObjectRefs, which stay borrowed until taken.

Keys `attempt{n}/...` belong to trainer attempt n: once attempt n puts one, an older attempt's entries
are dropped and its late ones ignored. Weight entries are tagged with the rollout engine's incarnation
(`engine`) when they arrive: over tpu_dist a replaced engine forms a new process group with the
trainer's ranks, and `replace_engine` asks every rank of the newest attempt to send its last update
again into it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tpuray.rl.sync.local import local

ATTEMPT_PREFIX = "attempt"  # mailbox keys of one trainer attempt's weight updates: attempt{n}/...


def attempt_of(key: str) -> int | None:
    """The trainer attempt a key belongs to (None: a key of no attempt, such as a batch)."""
    if not key.startswith(ATTEMPT_PREFIX):
        return None
    return int(key[len(ATTEMPT_PREFIX) : key.index("/")])


def weight_prefix(attempt: int, what: str) -> str:
    return f"{ATTEMPT_PREFIX}{attempt}/{what}/"


def weight_key(attempt: int, what: str, version: int, rank: int) -> str:
    """`what` ("weights", "ack") of update `version` from / to trainer rank `rank` of attempt `attempt`."""
    return f"{weight_prefix(attempt, what)}{version}/{rank}"


def resend_key(attempt: int, rank: int) -> str:
    """Where trainer rank `rank` of attempt `attempt` is asked to send its last update again."""
    return f"{ATTEMPT_PREFIX}{attempt}/resend/{rank}"


def ready_key(attempt: int, k: int, rank: int) -> str:
    """Where trainer rank `rank` of attempt `attempt` says it waits for batch `k` (colocated)."""
    return f"{ATTEMPT_PREFIX}{attempt}/ready/{k}/{rank}"


BATCH_PREFIX = "batch/"  # mailbox keys of the driver's batches: batch/{k}/{rank}, of no trainer attempt


def batch_key(k: int, rank: int) -> str:
    """Where trainer rank `rank` reads batch `k` (kept after reading: a restarted trainer reads it again,
    until a committed checkpoint makes it unneeded: `Mailbox.release_batches`)."""
    return f"{BATCH_PREFIX}{k}/{rank}"


def batch_of(key: str) -> int | None:
    """The batch a mailbox key holds (None: not a batch's key)."""
    return int(key[len(BATCH_PREFIX) :].split("/")[0]) if key.startswith(BATCH_PREFIX) else None


def join_key(attempt: int, engine: int, rank: int) -> str:
    """Where trainer rank `rank` of attempt `attempt` learns that engine incarnation `engine` joins their
    tpu_dist group (its first update was handed to the engine)."""
    return f"{ATTEMPT_PREFIX}{attempt}/join/{engine}/{rank}"


def stage(key: str, pieces: list[Any]) -> None:
    """In a trainer rank: keep an update's non-empty pieces (in its process's `LocalSync`) for the mailbox
    to take (`hand_over`)."""
    local().staged[key] = pieces


def _give(actor: Any, key: str) -> Any:
    """Runs in the trainer rank's process (`__ray_call__`): its staged pieces, one return value each."""
    pieces = local().staged.pop(key)
    return pieces[0] if len(pieces) == 1 else tuple(pieces)


class Mailbox:
    """A key -> value store whose readers wait for their key (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size  # the trainer's ranks
        self.values: dict[str, Any] = {}
        self.events: dict[str, asyncio.Event] = {}
        self.attempt = 0  # the newest trainer attempt that put a key
        self.engine = 0  # the rollout engine's incarnation (+1 per `replace_engine`)
        self.changed = asyncio.Event()  # set on every put (wakes `take_update`)
        # batch k -> the most reports (tpuray.train.report) any rank had made when it read batch k
        self.batch_reports: dict[int, int] = {}

    def _event(self, key: str) -> asyncio.Event:
        return self.events.setdefault(key, asyncio.Event())

    async def put(self, key: str, value: Any) -> int:
        """Store `value` under `key` (a weight entry tagged with the engine's incarnation); returns the
        incarnation, which a tpu_dist sender's group is made for."""
        attempt = attempt_of(key)
        if attempt is not None and attempt < self.attempt:
            return self.engine  # from the ranks of a trainer attempt that was replaced
        if attempt is not None and attempt > self.attempt:
            self.attempt = attempt
            for old in [k for k in self.values if attempt_of(k) not in (None, attempt)]:
                del self.values[old]
                self.events.pop(old, None)
        if key.startswith(weight_prefix(self.attempt, "weights")):
            value = (*value, self.engine)
        self.values[key] = value
        self._event(key).set()
        self.changed.set()
        return self.engine

    async def put_all(self, items: dict[str, Any]) -> None:
        """`put` of each item, in one call."""
        for key, value in items.items():
            await self.put(key, value)

    async def hand_over(self, key: str, actor: Any, mask: list[bool], nbytes: list[int]) -> int:
        """`put(key, (refs, nbytes))` of a rank's staged pieces (`stage`), taken as return values of a
        call into `actor` (the rank's): owned here, they outlive the rank. The entry shows once they are
        taken (a colocated engine rank pulling them runs in the same actors, whose calls would queue
        behind its pull). `mask[r]`: rollout rank r has a piece (else None)."""
        attempt = attempt_of(key)
        if attempt is not None and attempt < self.attempt:
            return self.engine
        import ray

        n = sum(mask)
        got = actor.__ray_call__.options(num_returns=n).remote(_give, key) if n else []
        refs = [got] if n == 1 else list(got)
        if refs:  # taken before the entry shows: a rollout rank pulling them must not wait on the rank
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: ray.wait(refs, num_returns=n, fetch_local=False)
            )
        taken = iter(refs)
        return await self.put(key, ([next(taken) if m else None for m in mask], nbytes))

    async def reading_batch(self, k: int, reports: int) -> None:
        """A trainer rank reads batch `k` after making `reports` reports."""
        self.batch_reports[k] = max(reports, self.batch_reports.get(k, reports))

    async def release_batches(self, report: int) -> int:
        """The checkpoint of report index `report` is committed: a restarted trainer resumes from it (or a
        later one), so it needs no batch read before report `report - 1` was made. Those go (their objects
        with them); a batch read after that, or not read yet, stays. Returns how many batches went."""
        gone = {k for k, n in self.batch_reports.items() if n < report}
        for key in [k for k in self.values if batch_of(k) in gone]:
            del self.values[key]
            self.events.pop(key, None)
        for k in gone:
            del self.batch_reports[k]
        return len(gone)

    async def batches_held(self) -> int:
        """How many batches the mailbox holds (each for every rank)."""
        return len({batch_of(key) for key in self.values} - {None})

    async def replace_engine(self) -> int:
        """A new rollout engine replaced the failed one: its incarnation, and every rank of the newest
        trainer attempt is asked to send its last update again (into the new engine's group)."""
        self.engine += 1
        for rank in range(self.world_size):
            await self.put(resend_key(self.attempt, rank), self.engine)
        return self.engine

    async def first(self, keys: list[str], keep: str | None, timeout_s: float) -> tuple[str, Any]:
        """(key, value) of the first of `keys` present, in their order, waiting up to `timeout_s` for
        one: taken, except `keep`'s, which stays (batches: a restarted trainer takes them again)."""
        waits = [asyncio.ensure_future(self._event(k).wait()) for k in keys]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        for key in keys:
            if key in self.values:
                if key == keep:
                    return key, self.values[key]
                self.events.pop(key, None)
                return key, self.values.pop(key)
        raise TimeoutError(f"nothing arrived under {' or '.join(map(repr, keys))} within {timeout_s}s")

    async def take_ready(self, k: int) -> tuple[int, list[Any]]:
        """(attempt, each rank's actor handle) once every rank of the newest trainer attempt waits for
        batch `k` (colocated); that attempt's older ready entries go."""
        while True:
            keys = [ready_key(self.attempt, k, r) for r in range(self.world_size)]
            if all(key in self.values for key in keys):
                hosts = [self.values[key] for key in keys]
                stale = weight_prefix(self.attempt, "ready")
                for old in [key for key in self.values if key.startswith(stale)]:
                    if int(old[len(stale) :].split("/")[0]) <= k:
                        del self.values[old]
                        self.events.pop(old, None)
                return self.attempt, hosts
            self.changed.clear()
            await self.changed.wait()

    async def take_update(self) -> tuple[int, int, int, list[Any]]:
        """(attempt, engine, version, each rank's `weights` entry): the lowest version every rank of the
        newest trainer attempt has sent for the current engine, once there is one."""
        while True:
            prefix = weight_prefix(self.attempt, "weights")
            versions = {int(k[len(prefix) :].split("/")[0]) for k in self.values if k.startswith(prefix)}
            for v in sorted(versions):
                keys = [weight_key(self.attempt, "weights", v, r) for r in range(self.world_size)]
                if all(k in self.values and self.values[k][-1] == self.engine for k in keys):
                    for k in keys:
                        self.events.pop(k, None)
                    entries = [self.values.pop(k)[:-1] for k in keys]
                    return self.attempt, self.engine, v, entries
            self.changed.clear()
            await self.changed.wait()
