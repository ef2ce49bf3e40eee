"""`LLMServer`: one model replica (its engine and TPU slice) behind a uniform request interface.

`create_backend` picks the backend of the config's engine; the interface every backend follows
(`Backend`) and what the generating ones share (`EngineBackend`) are in backend.py.

Request errors cross the Serve boundary as values: LLMServer returns (a stream yields) the OpenAIError
instead of raising it, so a bad request costs no exception traceback in the replica log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tpuray.serve.llm.backend import Backend
from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.openai_schema import OpenAIError


def create_backend(config: LLMConfig) -> Backend:
    """The backend the config's engine asks for (engine resolved in LLMConfig: "vLLM" or "embedded")."""
    if config.task == "embed":
        from tpuray.serve.llm.embedding_backend import EmbeddingBackend

        return EmbeddingBackend(config)
    if config.engine == "vLLM":
        from tpuray.serve.llm import model_source

        # build_openai_app decided this already; a config started directly is decided here
        config.choose_engine_for_model(model_source.read_config(config.model_source))
    if config.engine == "vLLM":
        from tpuray.serve.llm.vllm_backend import VLLMBackend

        return VLLMBackend(config)
    from tpuray.serve.llm.embedded_backend import EmbeddedBackend

    return EmbeddedBackend(config)


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
        from tpuray.serve.llm.failover import EngineSlot

        self.config = llm_config
        self.slot: EngineSlot | None = None
        backend = create_backend(llm_config)
        try:
            await backend.start()
        except BaseException:
            backend.shutdown()
            raise
        # The slot moves the engine to another slice when this one is preempted (failover.py).
        self.slot = EngineSlot(llm_config, backend, create_backend)
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
        return {**self.backend.describe(), "failovers": self.slot.failovers}

    async def handle(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | OpenAIError:
        assert self.slot is not None
        try:
            async with self.slot.use() as backend:
                return await backend.handle(endpoint, body)
        except OpenAIError as e:
            return e

    async def handle_stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        assert self.slot is not None
        try:
            async with self.slot.use() as backend:
                async for chunk in backend.handle_stream(endpoint, body):
                    yield chunk
        except OpenAIError as e:
            yield e

    def metrics(self) -> str:
        """This replica process's Prometheus exposition (metrics.py)."""
        from tpuray.serve.llm.metrics import process_exposition

        return process_exposition()

    async def check_health(self) -> None:
        """Serve restarts the replica (and so re-reserves its slice) when the engine died; not while it
        moves off a preempted slice."""
        if self.slot is not None:
            await self.slot.check_health()

    def shutdown(self) -> None:
        """Stop the engine(s): workers and slices, a replacement's included (idempotent)."""
        slot = getattr(self, "slot", None)
        if slot is not None:
            self.slot = None
            slot.shutdown()

    __del__ = shutdown
