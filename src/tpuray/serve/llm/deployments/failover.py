"""Serving through a preemption: a replica whose slice is being preempted moves to another slice, and
no request fails when a free slice is there to take it.

`EngineSlot` holds the replica's current backend (backends/base.py) and watches the backend's slice for Ray's
preemption notice (a drain of one of its hosts, `tpuray.slices.drain`). On a notice it
1. stops giving the old engine new requests: they wait (up to `wait_timeout_s`) for the replacement;
2. starts a replacement backend, which reserves another whole slice (Ray schedules nothing new on a
   draining host), while the old engine finishes the requests it has;
3. switches to the replacement once it is up, and shuts the old engine down (releasing its slice) when
   its last request ended or the deadline is DEADLINE_MARGIN_S away, whichever comes first.
Requests still running on the old engine at the deadline fail with it (there is no live migration): the
engine ends them (`Backend.end`, a 503 `engine_dead_error` naming SlicePreemptedError) before it stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from tpuray.constants import DEADLINE_MARGIN_S
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.slices.drain import DrainWatch, PreemptionInfo, describe, draining_nodes

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a replica reads Ray's drain state

RETRY_S = 5.0  # between attempts to start a replacement (no free slice yet)


class SlicePreemptedError(RuntimeError):
    """What ends the requests still on an engine when its slice's preemption deadline comes."""


class _Lease:
    """One backend and the requests running on it."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        nodes = backend.slice_nodes() if hasattr(backend, "slice_nodes") else []
        self.watch = DrainWatch({node: [] for node in nodes}, min_interval_s=0) if nodes else None


class EngineSlot:
    """The replica's backend, replaced by `factory(config)` on another slice when its slice is preempted."""

    def __init__(
        self,
        config: Any,
        backend: Any,
        factory: Callable[[Any], Any],
        wait_timeout_s: float = 300.0,
        poll_s: float = POLL_S,
    ) -> None:
        self.config = config
        self.factory = factory
        self.wait_timeout_s = wait_timeout_s
        self.poll_s = poll_s
        self.failovers = 0
        self._lease = _Lease(backend)
        self._ready = asyncio.Event()
        self._ready.set()
        self._tasks: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None
        self._closed = False
        self._retiring: set[_Lease] = set()

    @property
    def backend(self) -> Any:
        return self._lease.backend

    @property
    def failing_over(self) -> bool:
        return not self._ready.is_set()

    def start(self) -> None:
        """Start watching for preemption notices (call from the replica's event loop)."""
        if self._watcher is None and self._lease.watch is not None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    @asynccontextmanager
    async def use(self) -> AsyncIterator[Any]:
        """The backend to serve one request on (waits while a failover is under way)."""
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), timeout=self.wait_timeout_s)
            except TimeoutError:
                raise OpenAIError(
                    f"model `{self.config.model_id}` is moving off a preempted TPU slice and no replacement "
                    f"slice came up within {self.wait_timeout_s:g}s; retry later",
                    503,
                    type="service_unavailable",
                ) from None
        lease = self._lease
        lease.inflight += 1
        lease.idle.clear()
        try:
            yield lease.backend
        finally:
            lease.inflight -= 1
            if lease.inflight == 0:
                lease.idle.set()

    # -- failover ---------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.poll_s)
            lease = self._lease
            if lease.watch is None or not self._ready.is_set():
                continue
            try:
                info = lease.watch.poll(await asyncio.to_thread(draining_nodes))
            except Exception as e:  # noqa: BLE001 - a GCS hiccup must not stop the watch
                logger.warning("could not read Ray's drain state: %s", e)
                continue
            if info is not None:
                await self._failover(lease, info)

    async def _failover(self, old: _Lease, info: PreemptionInfo) -> None:
        self._ready.clear()
        logger.warning(
            "model %s: its TPU slice is being preempted (%s); new requests wait for a replacement engine on "
            "another slice, the %d in flight finish on this one",
            self.config.model_id,
            describe(info),
            old.inflight,
        )
        self._retiring.add(old)
        retire = asyncio.get_running_loop().create_task(self._retire(old, info))
        self._tasks.add(retire)
        retire.add_done_callback(self._tasks.discard)
        while not self._closed:
            backend = None
            try:
                backend = await asyncio.to_thread(self.factory, self.config)
                await backend.start()
                break
            except Exception as e:  # noqa: BLE001 - no free slice yet: retry while requests wait
                logger.error(
                    "model %s: replacement engine did not start (%s); retrying", self.config.model_id, e
                )
                if backend is not None:
                    await asyncio.to_thread(backend.shutdown)
                await asyncio.sleep(RETRY_S)
        else:
            return
        if self._closed:  # the replica shut down while the replacement started
            await asyncio.to_thread(backend.shutdown)
            return
        self._lease = _Lease(backend)
        self.failovers += 1
        self._ready.set()
        logger.warning(
            "model %s: serving on the replacement engine (%s)", self.config.model_id, _where(backend)
        )

    async def _retire(self, old: _Lease, info: PreemptionInfo) -> None:
        """Shut the old engine down once its requests are done, or just before the deadline."""
        left = info.seconds_left()
        timeout = None if left is None else max(0.0, left - DEADLINE_MARGIN_S)
        try:
            await asyncio.wait_for(old.idle.wait(), timeout=timeout)
        except TimeoutError:
            logger.warning(
                "model %s: %d request(s) still running on the preempted slice at its deadline fail",
                self.config.model_id,
                old.inflight,
            )
            old.backend.end(SlicePreemptedError(f"its TPU slice was preempted ({describe(info)})"))
        self._retiring.discard(old)
        await asyncio.to_thread(old.backend.shutdown)

    # -- health and shutdown ----------------------------------------------------------------------------
    async def check_health(self) -> None:
        if self.failing_over:  # the old engine may already be gone; the replacement is on its way
            return
        await self.backend.check_health()

    def shutdown(self) -> None:
        self._closed = True
        for task in [self._watcher, *self._tasks]:
            if task is not None:
                task.cancel()
        for lease in [*self._retiring, self._lease]:
            lease.backend.shutdown()
        self._retiring.clear()


def _where(backend: Any) -> str:
    try:
        return str(backend.describe().get("slice"))
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"
