"""The serving backend interface: what `LLMServer` (deployments/server.py) needs from the backend of one
model. The backends, one module each, and which one a config gets: factory.py.

A backend takes requests as JSON dicts parsed by its own protocol and raises OpenAIError for a bad
request. `start()` proves its engine (a 1-token warm-up generation, or one embedding); on failure it
raises `warm_up_error`, so the replica fails to start instead of serving a dead engine behind a live
endpoint. Endpoints: "completions", "chat", "embeddings", "tokenize", "detokenize".

An engine that dies later (vLLM's engine core process, an embedded engine worker, a host of the slice)
reports it in `engine_error()`; the replica then answers every request with `engine_dead_error` (a 503
with Retry-After, the one place that maps an engine's death to an OpenAI error) and starts a new engine
in its place when the backend is `restartable`; otherwise it fails its health check, so Serve replaces
the replica (docs/serve.md, "When an engine dies").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from tpuray.serve.llm.config import LLMConfig


class Backend(Protocol):
    """One model's backend, as the replica (and its failover slot) drives it."""

    config: LLMConfig

    @property
    def restartable(self) -> bool:
        """Whether a new engine can start in this replica's process once this one died: true when the
        engine runs in processes of its own (workers on a slice, vLLM's engine core)."""
        ...

    async def start(self) -> None: ...

    async def handle(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def handle_stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """Dict chunks or preformatted SSE strings."""
        ...

    def card(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...

    async def check_health(self) -> None:
        """Raises when the engine is dead (the replica then starts a new one, or Serve replaces it)."""
        ...

    def engine_error(self) -> BaseException | None:
        """What killed the engine (None while it lives): requests then get `engine_dead_error`."""
        ...

    def end(self, error: BaseException) -> None:
        """Fail the requests in flight with `error` (answered as `engine_dead_error`) before `shutdown`,
        which alone may leave them waiting; on the replica's event loop."""
        ...

    def shutdown(self) -> None: ...


class EngineBackend:
    """What a generating backend shares: `config`, `engine` (with `max_model_len`, `describe()`), `created`."""

    config: LLMConfig
    engine: Any
    created: int

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    def card(self) -> dict[str, Any]:
        from tpuray.serve.llm.openai.protocol import model_card

        return model_card(self.model_id, self.created, self.max_model_len)

    def describe(self) -> dict[str, Any]:
        return self.engine.describe()

    def slice_nodes(self) -> list[str]:
        """The Ray nodes the engine's slice occupies (watched for preemption notices)."""
        return self.engine.slice_nodes()

    def end(self, error: BaseException) -> None:
        self.engine.end(error)


def warm_up_error(
    config: LLMConfig, engine: str, error: BaseException, what: str = "generation (1 token)"
) -> RuntimeError:
    """The replica's start failure when its engine failed its warm-up request."""
    return RuntimeError(
        f"model {config.model_id!r}: the {engine} engine failed its warm-up {what} at start, so this "
        f"replica does not serve: {type(error).__name__}: {error}"
    )
