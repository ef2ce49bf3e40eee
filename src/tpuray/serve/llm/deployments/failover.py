"""Serving through a preemption or an engine's death: the replica moves its engine to another slice when
the slice is preempted, and starts a new engine when the engine dies, its ingress answering throughout.

`EngineSlot` holds the replica's current backend (backends/base.py) and watches the backend's slice for Ray's
preemption notice (a drain of one of its hosts, `tpuray.slices.drain`). On a notice it
1. stops giving the old engine new requests: they wait (up to `wait_timeout_s`) for the replacement;
2. starts a replacement backend, which reserves another whole slice (Ray schedules nothing new on a
   draining host), while the old engine finishes the requests it has;
3. switches to the replacement once it is up, and shuts the old engine down (releasing its slice) when
   its last request ended or the deadline is DEADLINE_MARGIN_S away, whichever comes first.
Requests still running on the old engine at the deadline fail with it (there is no live migration): the
engine ends them (`Backend.end`, a 503 `engine_dead_error` naming SlicePreemptedError) before it stops.

When the engine dies without notice (a worker or vLLM's engine core killed, a host lost), the replica
learns it from a request or its health check (`engine_died`) and restarts the engine in place:
1. requests get the 503 `engine_dead_error` at once, with `Retry-After` (the last engine start's
   duration, less the time since the death), until the new engine serves: none waits;
2. the dead engine is ended and shut down (its workers and slice released), then a new one is started
   on a free slice, retried every RETRY_S until one is;
3. the health check passes meanwhile: Serve keeps the replica, so the app's ingress (in the replica for
   one model) never goes away and no request waits in Serve's proxy for a replacement replica.
An engine in the replica's own process (`Backend.restartable` false) is not restarted, nor one of a
model Serve keeps several replicas of (`LLMConfig.min_replicas`), whose other replicas serve while Serve
replaces this one: the health check fails and Serve replaces the replica (docs/serve.md, "When an engine
dies").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tpuray.constants import DEADLINE_MARGIN_S
from tpuray.serve.llm.openai.errors import OpenAIError, engine_dead_error
from tpuray.serve.llm.openai.openapi import ModelState
from tpuray.slices.drain import DrainWatch, PreemptionInfo, describe, draining_nodes

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a replica reads Ray's drain state

RETRY_S = 5.0  # between attempts to start a replacement (no free slice yet)

RETRY_AFTER_MAX_S = 60  # the longest Retry-After a dead engine's 503 asks for (the openai SDK's cap)


class SlicePreemptedError(RuntimeError):
    """What ends the requests still on an engine when its slice's preemption deadline comes."""


@dataclass(frozen=True)
class ModelStatus:
    """What /health and /v1/models say of a model: its state, and when a client should look again."""

    state: ModelState
    retry_after_s: int | None = None


@dataclass(frozen=True)
class _Death:
    error: BaseException
    at: float  # time.monotonic()


class _Lease:
    """One backend and the requests running on it."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.retired = False  # ended by a failover, which replaces it
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
        start_s: float = RETRY_S,
    ) -> None:
        self.config = config
        self.factory = factory
        self.wait_timeout_s = wait_timeout_s
        self.poll_s = poll_s
        self.start_s = start_s  # how long the last engine took to start: what a restart should take
        self.failovers = 0
        self.restarts = 0
        self._death: _Death | None = None  # the dead engine's, while a new one starts
        self._restart: asyncio.Task | None = None
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

    @property
    def restarting(self) -> bool:
        """A new engine is starting in place of a dead one."""
        return self._restart is not None and not self._restart.done()

    def status(self) -> ModelStatus:
        if self._death is None:
            return ModelStatus("serving")
        return ModelStatus("recovering" if self.restarting else "unavailable", self.retry_after_s())

    def retry_after_s(self) -> int:
        """Seconds until the new engine should serve: the last start's duration less the time since the
        death, from 1 to RETRY_AFTER_MAX_S."""
        since = time.monotonic() - self._death.at if self._death is not None else 0.0
        return min(RETRY_AFTER_MAX_S, max(1, math.ceil(self.start_s - since)))

    def unavailable(self, error: BaseException) -> OpenAIError:
        """The 503 of a request to the dead engine (or sent while a new one starts)."""
        return engine_dead_error(self.config.model_id, error, self.retry_after_s())

    def start(self) -> None:
        """Start watching for preemption notices (call from the replica's event loop)."""
        if self._watcher is None and self._lease.watch is not None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    @asynccontextmanager
    async def use(self) -> AsyncIterator[Any]:
        """The backend to serve one request on (waits while a failover is under way; the 503 at once
        while a new engine starts after a death)."""
        if self._death is not None:
            raise self.unavailable(self._death.error)
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
            if lease.watch is None or not self._ready.is_set() or self._death is not None:
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
        backend = await self._start_engine("replacement engine")
        if backend is None:  # the replica shut down first
            return
        self._lease = _Lease(backend)
        self.failovers += 1
        self._ready.set()
        logger.warning(
            "model %s: serving on the replacement engine (%s)", self.config.model_id, _where(backend)
        )

    async def _start_engine(self, what: str) -> Any | None:
        """A new engine, started (retried every RETRY_S while it fails: no free slice yet); None when the
        replica shuts down first. Its start's duration becomes `start_s`."""
        while not self._closed:
            backend, began = None, time.monotonic()
            try:
                backend = await asyncio.to_thread(self.factory, self.config)
                await backend.start()
            except Exception as e:  # noqa: BLE001 - no free slice yet: retry while requests wait
                logger.error("model %s: the %s did not start (%s); retrying", self.config.model_id, what, e)
                if backend is not None:
                    await asyncio.to_thread(backend.shutdown)
                await asyncio.sleep(RETRY_S)
                continue
            if self._closed:  # the replica shut down while the engine started
                await asyncio.to_thread(backend.shutdown)
                return None
            self.start_s = time.monotonic() - began
            return backend
        return None

    async def _retire(self, old: _Lease, info: PreemptionInfo) -> None:
        """Shut the old engine down once its requests are done, or just before the deadline."""
        old.retired = True
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

    # -- an engine's death -----------------------------------------------------------------------------
    def engine_died(self, backend: Any, error: BaseException) -> bool:
        """`backend`'s engine died with `error`: restart it in this replica unless a failover replaces it
        already, its engine cannot start again in this process, or other replicas serve the model while
        Serve replaces this one. True when a restart is under way."""
        if self._death is not None:
            return self.restarting
        lease = self._lease
        if self._closed or self.failing_over or backend is not lease.backend or lease.retired:
            return False
        if not backend.restartable or self.config.min_replicas > 1:  # then Serve routes to the others
            return False
        self._death = _Death(error, time.monotonic())
        self._restart = asyncio.get_running_loop().create_task(self._restart_engine(lease, error))
        return True

    async def _restart_engine(self, dead: _Lease, error: BaseException) -> None:
        model = self.config.model_id
        logger.error(
            "model %s: its engine died (%s: %s); starting a new one in this replica (requests get a 503 "
            "with Retry-After until it serves)",
            model,
            type(error).__name__,
            error,
        )
        try:
            dead.backend.end(error)  # the requests still on it fail now
            await asyncio.to_thread(dead.backend.shutdown)  # its workers and slice, for the new engine
        except Exception:  # noqa: BLE001 - a new engine is started anyway
            logger.exception("model %s: the dead engine did not shut down cleanly", model)
        backend = await self._start_engine("new engine")
        if backend is None:
            return
        self._lease = _Lease(backend)
        self.restarts += 1
        down_s = time.monotonic() - self._death.at if self._death is not None else 0.0
        self._death = None
        logger.warning(
            "model %s: serving on a new engine (%s), %.1f s after the death", model, _where(backend), down_s
        )

    # -- health and shutdown ----------------------------------------------------------------------------
    async def check_health(self) -> None:
        if self.failing_over:  # the old engine may already be gone; the replacement is on its way
            return
        if self._death is not None:  # a new engine is starting, unless its restart ended without one
            if not self.restarting and not self._closed:
                raise RuntimeError(f"the restart of the engine that died ({self._death.error}) ended")
            return
        await self.backend.check_health()

    def shutdown(self) -> None:
        self._closed = True
        for task in [self._watcher, self._restart, *self._tasks]:
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
