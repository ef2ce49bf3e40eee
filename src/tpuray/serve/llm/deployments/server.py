"""`LLMServer`: one model replica (its engine and TPU slice) behind a uniform request interface.

The backend of the config's engine comes from `tpuray.serve.llm.backends.factory.create_backend`; the
interface every backend follows (`Backend`) is in backends/base.py.

Request errors cross the Serve boundary as values: LLMServer returns (a stream yields) the OpenAIError
instead of raising it, so a bad request costs no exception traceback in the replica log. A request that
fails because the engine died (`Backend.engine_error`) gets `engine_dead_error` (503 with Retry-After),
never a 500; one that arrives once the death is known gets it at once, before anything of it is parsed,
while the replica starts a new engine (`EngineSlot.engine_died`, deployments/failover.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

from tpuray.serve.llm.backends.base import Backend
from tpuray.serve.llm.backends.factory import create_backend
from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.deployments.failover import EngineSlot, ModelStatus
from tpuray.serve.llm.openai.errors import OpenAIError


class LLMServer:
    """One model replica. Serve awaits its async constructor; elsewhere use `await LLMServer.create(cfg)`."""

    async def __init__(self, llm_config: LLMConfig) -> None:  # type: ignore[misc]
        await self._start(llm_config)

    @classmethod
    async def create(cls, llm_config: LLMConfig) -> LLMServer:
        server = cls.__new__(cls)
        await server._start(llm_config)
        return server

    async def _start(self, llm_config: LLMConfig) -> None:
        self.config = llm_config
        self.slot: EngineSlot | None = None
        began = time.monotonic()
        backend = create_backend(llm_config)
        try:
            await backend.start()
        except BaseException:
            backend.shutdown()
            raise
        # The slot moves the engine to another slice when this one is preempted, and starts a new one when
        # it dies (deployments/failover.py).
        self.slot = EngineSlot(llm_config, backend, create_backend, start_s=time.monotonic() - began)
        self.slot.start()

    @property
    def backend(self) -> Any:
        """The engine backend serving now (a replacement after a failover)."""
        return self.slot.backend if self.slot is not None else None

    @property
    def model_id(self) -> str:
        return self.config.model_id

    def card(self) -> dict[str, Any]:
        return self.backend.card()

    def describe(self) -> dict[str, Any]:
        assert self.slot is not None
        slot = self.slot
        return {
            **self.backend.describe(),
            "failovers": slot.failovers,
            "restarts": slot.restarts,
            "state": slot.status().state,
            "replica_pid": os.getpid(),
        }

    def status(self) -> ModelStatus:
        """The model's state (serving, or recovering from its engine's death), for /health and /v1/models."""
        assert self.slot is not None
        return self.slot.status()

    async def handle(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | OpenAIError:
        assert self.slot is not None
        backend = None
        try:
            async with self.slot.use() as backend:
                dead = backend.engine_error()
                if dead is not None:  # at once: nothing of the request is parsed or queued on a dead engine
                    return self._dead(backend, dead)
                return await backend.handle(endpoint, body)
        except Exception as e:  # noqa: BLE001 - request errors and engine deaths become OpenAI errors
            return self._error(backend, e)

    async def handle_stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        assert self.slot is not None
        backend = None
        try:
            async with self.slot.use() as backend:
                dead = backend.engine_error()
                if dead is not None:
                    yield self._dead(backend, dead)
                    return
                async for chunk in backend.handle_stream(endpoint, body):
                    yield chunk
        except Exception as e:  # noqa: BLE001 - request errors and engine deaths become OpenAI errors
            yield self._error(backend, e)

    def _error(self, backend: Backend | None, error: Exception) -> OpenAIError:
        """The request's own error (4xx); else a dead engine's 503, whatever the request saw of the death;
        else the OpenAIError, or any other exception re-raised (the app's 500)."""
        if isinstance(error, OpenAIError) and error.status < 500:
            return error
        dead = backend.engine_error() if backend is not None else None
        if backend is not None and dead is not None:
            return self._dead(backend, dead)
        if isinstance(error, OpenAIError):
            return error
        raise error

    def _dead(self, backend: Backend, error: BaseException) -> OpenAIError:
        """The 503 of a request that found `backend`'s engine dead; a new engine starts (if it can)."""
        assert self.slot is not None
        self.slot.engine_died(backend, error)
        return self.slot.unavailable(error)

    def metrics(self) -> str:
        """This replica process's Prometheus exposition (metrics.py)."""
        from tpuray.serve.llm.metrics import process_exposition

        return process_exposition()

    async def check_health(self) -> None:
        """Passes while the engine serves, moves off a preempted slice, or, dead, is being replaced by a
        new one in this replica (the check that finds it dead starts that). Fails when the engine is dead
        and nothing replaces it (an engine in this process, a model with several replicas, or a restart
        that ended without one): Serve then replaces the replica, and so re-reserves its slice.

        The failure reaches Serve's controller as a plain RuntimeError naming the engine's error: the
        controller unpickles what a health check raises, and an engine's own exception class (vLLM's
        EngineDeadError) would make it import that engine first, which on a loaded machine took minutes
        during which it replaced no replica."""
        if self.slot is None:
            return
        try:
            await self.slot.check_health()
        except Exception as e:  # noqa: BLE001 - any engine failure fails the check, as a builtin type
            dead = self.backend.engine_error()
            if dead is not None and self.slot.engine_died(self.backend, dead):
                return
            raise RuntimeError(
                f"model {self.model_id!r}: engine unhealthy: {type(e).__name__}: {e}"
            ) from None

    def shutdown(self) -> None:
        """Stop the engine(s): workers and slices, a replacement's included (idempotent)."""
        slot = getattr(self, "slot", None)
        if slot is not None:
            self.slot = None
            slot.shutdown()

    __del__ = shutdown
