"""The OpenAI ingress: `LLMRouter` (FastAPI on Ray Serve) authenticates, reads the JSON body (`read_json`:
its size, MAX_REQUEST_BYTES, a 413, and its nesting, MAX_JSON_DEPTH, bounded before json.loads could
recurse that deep; a large body parsed off the event loop), routes on its `model` and frames SSE, in front of the models'
`LLMServer`s (server.py). Several models: each request goes to its model's LLMServer deployment through
a Serve handle. One model: the router's replica holds that model's LLMServer in-process, one Serve hop
fewer per request. The model's backend parses and validates the request with its engine's own
protocol, so nothing a backend supports is dropped on the way.

(No `from __future__ import annotations` here: FastAPI must see real types in the routes' signatures.)
"""

import asyncio
import inspect
import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError

from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.deployments.failover import ModelStatus
from tpuray.serve.llm.deployments.server import LLMServer
from tpuray.serve.llm.metrics import count_http, merge_expositions, process_exposition
from tpuray.serve.llm.openai.errors import OpenAIError, add_error_handlers, engine_dead_error, error_response
from tpuray.serve.llm.openai.openapi import (
    HEALTH_DOCS,
    METRICS_DOCS,
    ModelCard,
    ModelList,
    get_docs,
    openapi_document,
    post_docs,
)
from tpuray.validation import ConfigError

api = FastAPI(title="tpuray OpenAI-compatible API")
api.openapi = lambda: openapi_document(api)  # type: ignore[method-assign]  # the request models (openai/openapi.py)

# POST path -> backend endpoint; "model" is required on the OpenAI routes, optional on vLLM's /tokenize.
ROUTES = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embeddings",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
MODEL_OPTIONAL = {"tokenize", "detokenize"}
STATUS_TIMEOUT_S = 2.0  # a model deployment that does not say its state by then is "unavailable"


# -- the body, bounded before it is parsed ---------------------------------------------------------

MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a request body larger than this is refused unread (413)
MAX_JSON_DEPTH = 64  # arrays / objects nested deeper are refused before parsing
OFF_LOOP_BYTES = 64 * 1024  # bodies larger than this are parsed in a worker thread
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but brackets (to delete)
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


def too_large(size: int) -> OpenAIError:
    return OpenAIError(
        f"the request body is {size} bytes or more; the limit is {MAX_REQUEST_BYTES} bytes",
        413,
        code="request_too_large",
    )


def json_depth_ok(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `raw` nests arrays / objects at most `limit` deep, its brackets balanced
    (brackets inside strings do not count). Regular expressions only: passes in C, none recursive."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _BRACKETS)
    for _ in range(limit):
        if not brackets:
            return True
        brackets, removed = _EMPTY_PAIR.subn(b"", brackets)
        if not removed:
            return False  # unbalanced (not JSON)
    return not brackets


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body -> its JSON object; OpenAIError 400 for what is not one (or nests too deep)."""
    if not json_depth_ok(raw):
        raise OpenAIError(
            f"request body is not valid JSON or nests arrays / objects deeper than {MAX_JSON_DEPTH} levels",
            code="invalid_json",
        )
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(
            f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    return body


async def read_json(chunks: Any, content_length: str | None) -> dict[str, Any]:
    """The JSON object of a request body streamed as `chunks` (an async iterator of bytes), read only up
    to MAX_REQUEST_BYTES; a large body is parsed in a worker thread, so other requests keep going."""
    if content_length is not None and content_length.isdigit() and int(content_length) > MAX_REQUEST_BYTES:
        raise too_large(int(content_length))
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            raise too_large(size)
        parts.append(chunk)
    raw = b"".join(parts)
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


@api.middleware("http")
async def _count_requests(request: Request, call_next):
    """http_requests_total{handler, method, status} (metrics.py) for every request."""
    response = await call_next(request)
    route = request.scope.get("route")
    count_http(getattr(route, "path", "unmatched"), request.method, response.status_code)
    return response


add_error_handlers(api)


class _Remote:
    """A model served by its own LLMServer deployment, reached through a Serve handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def call(self, endpoint: str, body: dict) -> Any:
        return await self.handle.handle.remote(endpoint, body)

    def stream(self, endpoint: str, body: dict) -> Any:
        return self.handle.options(stream=True).handle_stream.remote(endpoint, body)

    async def card(self) -> dict:
        return await self.handle.card.remote()

    async def status(self) -> ModelStatus:
        try:
            return await asyncio.wait_for(self.handle.status.remote(), STATUS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no replica answers (stopped, starting): the state says so
            return ModelStatus("unavailable")

    async def metrics(self) -> str:
        return await self.handle.metrics.remote()


class _Local:
    """A model whose LLMServer lives in this ingress replica (no Serve hop between router and engine)."""

    def __init__(self, server: LLMServer) -> None:
        self.server = server

    async def call(self, endpoint: str, body: dict) -> Any:
        return await self.server.handle(endpoint, body)

    def stream(self, endpoint: str, body: dict) -> Any:
        return self.server.handle_stream(endpoint, body)

    async def card(self) -> dict:
        return self.server.card()

    async def status(self) -> ModelStatus:
        return self.server.status()


async def _close(gen: Any) -> None:
    """Stop a response stream early: an in-process async generator, or a Serve streaming response."""
    if inspect.isasyncgen(gen):
        await gen.aclose()
    else:
        gen.cancel()


def _sse(chunk: Any) -> str:
    """One SSE event: backends yield dicts, OpenAIErrors or (vLLM) preformatted events."""
    if isinstance(chunk, str):
        return chunk
    if isinstance(chunk, OpenAIError):
        chunk = chunk.body()
    return f"data: {json.dumps(chunk)}\n\n"


@serve.ingress(api)
class LLMRouter:
    """The OpenAI ingress: auth, model routing and SSE framing.

    `llm_servers` holds, per model, a Serve handle of its LLMServer deployment or an LLMConfig, which
    this replica then serves itself.
    """

    async def __init__(self, llm_servers: list, model_ids: list[str], api_key: str | None = None) -> None:  # type: ignore[misc]
        self.backends: dict[str, Any] = {}
        for model_id, s in zip(model_ids, llm_servers, strict=True):
            self.backends[model_id] = (
                _Local(await LLMServer.create(s)) if isinstance(s, LLMConfig) else _Remote(s)
            )
        self.cards = [await b.card() for b in self.backends.values()]
        self.api_key = api_key
        # /openapi.json names the served models (the app object is this replica's alone)
        api.openapi_schema = None
        api.openapi = lambda: openapi_document(api, list(self.backends))  # type: ignore[method-assign]

    def _local_servers(self) -> dict[str, LLMServer]:
        backends = getattr(self, "backends", {})  # absent when __init__ failed (then __del__ still runs)
        return {m: b.server for m, b in backends.items() if isinstance(b, _Local)}

    def describe(self, model_id: str | None = None) -> dict[str, Any]:
        """The engine behind a model served in this replica (the only one when `model_id` is None)."""
        local = self._local_servers()
        if model_id is None and len(local) == 1:
            (model_id,) = local
        if model_id not in local:
            raise ConfigError(
                f"model {model_id!r} is not served in this replica; local models: {sorted(local)}"
            )
        return local[model_id].describe()

    async def check_health(self) -> None:
        for server in self._local_servers().values():
            await server.check_health()

    def __del__(self) -> None:
        for server in self._local_servers().values():
            server.shutdown()

    def _authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise OpenAIError(
                "missing API key: send `Authorization: Bearer <key>`", 401, code="invalid_api_key"
            )
        if auth != f"Bearer {self.api_key}":
            raise OpenAIError("incorrect API key provided", 401, code="invalid_api_key")

    def _backend(self, model: Any, endpoint: str) -> Any:
        if model is None and endpoint in MODEL_OPTIONAL and len(self.backends) == 1:
            return next(iter(self.backends.values()))
        if not isinstance(model, str):
            raise OpenAIError(
                f"'model' is required and must be a string, got {model!r}",
                param="model",
                code="invalid_value",
            )
        if model not in self.backends:
            raise OpenAIError(
                f"The model `{model}` does not exist. Available models: {sorted(self.backends)}",
                404,
                param="model",
                code="model_not_found",
            )
        return self.backends[model]

    async def _statuses(self) -> dict[str, ModelStatus]:
        statuses = await asyncio.gather(*(b.status() for b in self.backends.values()))
        return dict(zip(self.backends, statuses, strict=True))

    async def _cards(self) -> list[dict[str, Any]]:
        """The models' cards, each with its state now (`status`: openapi.py's ModelState)."""
        statuses = await self._statuses()
        return [{**c, "status": statuses[c["id"]].state} for c in self.cards]

    @api.get("/v1/models", **get_docs(ModelList, 401))
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": await self._cards()}

    @api.get("/v1/models/{model:path}", **get_docs(ModelCard, 401, 404))
    async def model(self, model: str, request: Request):
        self._authorize(request)
        self._backend(model, "models")
        return next(c for c in await self._cards() if c["id"] == model)

    @api.post("/v1/completions", **post_docs("/v1/completions"))
    @api.post("/v1/chat/completions", **post_docs("/v1/chat/completions"))
    @api.post("/v1/embeddings", **post_docs("/v1/embeddings"))
    @api.post("/tokenize", **post_docs("/tokenize"))
    @api.post("/detokenize", **post_docs("/detokenize"))
    async def post(self, request: Request):
        self._authorize(request)
        endpoint = ROUTES[request.scope["route"].path]
        # size and nesting bounded before parsing; a large body parsed off the event loop
        body = await read_json(request.stream(), request.headers.get("content-length"))
        model = body.get("model")
        backend = self._backend(model, endpoint)
        try:
            if body.get("stream") is not True:
                result = await backend.call(endpoint, body)
                return error_response(result) if isinstance(result, OpenAIError) else JSONResponse(result)
            gen = backend.stream(endpoint, body)
            first = await gen.__anext__()
        except RayActorError as e:  # the model's LLMServer replica died (two-deployment layout)
            return error_response(engine_dead_error(str(model), e))
        if isinstance(first, OpenAIError):  # refused before the first token: a plain error response
            await _close(gen)
            return error_response(first)

        async def sse():
            try:
                yield _sse(first)
                async for chunk in gen:
                    yield _sse(chunk)
                    if isinstance(chunk, OpenAIError):
                        break
            except RayActorError as e:
                yield _sse(engine_dead_error(str(model), e))
            finally:
                await _close(gen)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @api.get("/health", **HEALTH_DOCS)
    async def health(self):
        """200 while a model serves (`ok`: all of them, `degraded`: some); 503 with Retry-After when none
        does (their engines restarting), each model's state in `models`."""
        statuses = await self._statuses()
        serving = sum(s.state == "serving" for s in statuses.values())
        status = "ok" if serving == len(statuses) else "degraded" if serving else "unavailable"
        body = {"status": status, "models": {m: s.state for m, s in statuses.items()}}
        if serving:
            return body
        waits = [s.retry_after_s for s in statuses.values() if s.retry_after_s is not None]
        headers = {"Retry-After": str(min(waits))} if waits else None
        return JSONResponse(body, status_code=503, headers=headers)

    @api.get("/metrics", response_class=PlainTextResponse, **METRICS_DOCS)
    async def metrics(self):
        """Prometheus text format: this replica's metrics and those of each model deployment behind it."""
        texts = [process_exposition()]
        texts += [await b.metrics() for b in self.backends.values() if isinstance(b, _Remote)]
        return PlainTextResponse(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)
