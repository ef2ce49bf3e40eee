"""Ray Serve wiring: an OpenAI ingress (`LLMRouter`, FastAPI on /v1) in front of the models' `LLMServer`s.

Several models: the router forwards each request to that model's `LLMServer` deployment through a Serve
handle. One model (the default for a one-model app): a single deployment whose replicas hold the router
*and* the model's LLMServer in-process, one Serve hop fewer per request.

Each LLMServer builds its engine in its constructor; for a TPU model the engine reserves the replica's own
SlicePlacementGroup and starts one worker actor per chip on it. Serve calls `__del__` when it stops a
replica, which kills the workers and releases the slice.

(No `from __future__ import annotations` here: FastAPI must see real types in the routes' signatures.)
"""

import asyncio
import inspect
import json
import logging
import re
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Deployment

from tpuray.serve.llm.config import LLMConfig, LLMServingArgs
from tpuray.serve.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    OpenAIError,
    error_from_validation,
    model_card,
    now,
)
from tpuray.validation import ConfigError

if TYPE_CHECKING:
    from tpuray.serve.llm.embeddings import EmbeddingModel
    from tpuray.serve.llm.server import ModelServer

logger = logging.getLogger(__name__)

api = FastAPI(title="tpuray OpenAI-compatible API")


def error_response(e: OpenAIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(error_from_validation(list(exc.errors())))


@api.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed")
    return error_response(
        OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500, type="internal_error")
    )


class LLMServer:
    """One model replica: the engine (and its TPU slice) plus OpenAI semantics.

    Request errors cross the Serve boundary as values: a method returns (a stream yields) the
    OpenAIError instead of raising it, so a bad request costs no exception traceback in the replica log.
    """

    def __init__(self, llm_config: LLMConfig):
        self.config = llm_config
        self.server: ModelServer | None = None
        self.embedder: EmbeddingModel | None = None
        if llm_config.task == "embed":
            from tpuray.serve.llm import embeddings  # torch and transformers only in model replicas

            self.embedder = embeddings.EmbeddingModel(llm_config)
        else:
            from tpuray.serve.llm import server

            self.server = server.ModelServer(llm_config)

    def describe(self) -> dict[str, Any]:
        if self.server is None:
            return {"engine": "embeddings", "model": self.config.model_id}
        return self.server.engine.describe()

    def _need(self, what: str):
        target = self.embedder if what == "embeddings" else self.server
        if target is None:
            task = "embeddings" if self.server is None else "completions and chat completions"
            raise OpenAIError(
                f"model `{self.config.model_id}` does not support {what}; it serves {task}", param="model"
            )
        return target

    async def _call(self, what: str, method: str, req) -> dict[str, Any] | OpenAIError:
        try:
            fn = getattr(self._need(what), method)
            if what == "embeddings":  # synchronous torch compute: keep the replica's event loop free
                return await asyncio.to_thread(fn, req)
            return await fn(req)
        except OpenAIError as e:
            return e

    async def completions(self, req: CompletionRequest) -> dict[str, Any] | OpenAIError:
        return await self._call("completions", "completions", req)

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | OpenAIError:
        return await self._call("chat completions", "chat", req)

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any] | OpenAIError:
        return await self._call("embeddings", "create", req)

    async def _stream(self, what: str, method: str, req):
        try:
            async for chunk in getattr(self._need(what), method)(req):
                yield chunk
        except OpenAIError as e:
            yield e

    async def completions_stream(self, req: CompletionRequest):
        async for chunk in self._stream("completions", "completions_stream", req):
            yield chunk

    async def chat_stream(self, req: ChatCompletionRequest):
        async for chunk in self._stream("chat completions", "chat_stream", req):
            yield chunk

    def check_health(self) -> None:
        """Serve restarts the replica (and so re-reserves its slice) when an engine worker died."""
        import ray

        error = getattr(getattr(self.server, "engine", None), "error", None)
        if isinstance(error, ray.exceptions.RayActorError):
            raise RuntimeError(f"engine worker died: {error}")

    def shutdown(self) -> None:
        """Stop the engine: kill its worker actors and release the replica's slice (idempotent)."""
        server = getattr(self, "server", None)
        if server is not None:
            self.server = None
            server.shutdown()

    __del__ = shutdown


class _Remote:
    """A model served by its own LLMServer deployment, reached through a Serve handle."""

    def __init__(self, handle):
        self.handle = handle

    async def call(self, method: str, req) -> dict[str, Any]:
        return await getattr(self.handle, method).remote(req)

    def stream(self, method: str, req):
        return getattr(self.handle.options(stream=True), method + "_stream").remote(req)


class _Local:
    """A model whose LLMServer lives in this ingress replica (no Serve hop between router and engine)."""

    def __init__(self, config: LLMConfig):
        self.server = LLMServer(config)

    async def call(self, method: str, req) -> dict[str, Any]:
        return await getattr(self.server, method)(req)

    def stream(self, method: str, req):
        return getattr(self.server, method + "_stream")(req)


async def _close(gen) -> None:
    """Stop a response stream early: an in-process async generator, or a Serve streaming response."""
    if inspect.isasyncgen(gen):
        await gen.aclose()
    else:
        gen.cancel()


@serve.ingress(api)
class LLMRouter:
    """The /v1 ingress: auth, request validation, model routing and SSE framing.

    `llm_servers` holds, per model, a Serve handle of its LLMServer deployment or an LLMConfig, which
    this replica then serves itself.
    """

    def __init__(
        self,
        llm_servers: list,
        model_ids: list[str],
        max_model_lens: list[int | None],
        api_key: str | None = None,
    ):
        self.backends = {
            m: _Local(s) if isinstance(s, LLMConfig) else _Remote(s)
            for m, s in zip(model_ids, llm_servers, strict=True)
        }
        self.cards = [model_card(m, now(), mml) for m, mml in zip(model_ids, max_model_lens, strict=True)]
        self.api_key = api_key

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

    def check_health(self) -> None:
        for server in self._local_servers().values():
            server.check_health()

    def __del__(self) -> None:
        for server in self._local_servers().values():
            server.shutdown()

    def _check(self, request: Request, model: str | None = None):
        if self.api_key:
            auth = request.headers.get("authorization", "")
            if not auth:
                raise OpenAIError(
                    "missing API key: send `Authorization: Bearer <key>`", 401, code="invalid_api_key"
                )
            if auth != f"Bearer {self.api_key}":
                raise OpenAIError("incorrect API key provided", 401, code="invalid_api_key")
        if model is None:
            return None
        if model not in self.backends:
            raise OpenAIError(
                f"The model `{model}` does not exist. Available models: {sorted(self.backends)}",
                404,
                param="model",
                code="model_not_found",
            )
        return self.backends[model]

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._check(request)
        return {"object": "list", "data": self.cards}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        self._check(request, model)
        return next(c for c in self.cards if c["id"] == model)

    async def _respond(self, backend, method: str, req):
        if not getattr(req, "stream", False):
            result = await backend.call(method, req)
            return error_response(result) if isinstance(result, OpenAIError) else JSONResponse(result)
        gen = backend.stream(method, req)
        first = await gen.__anext__()
        if isinstance(first, OpenAIError):
            await _close(gen)
            return error_response(first)

        async def sse():
            try:
                yield f"data: {json.dumps(first)}\n\n"
                async for chunk in gen:
                    failed = isinstance(chunk, OpenAIError)
                    yield f"data: {json.dumps(chunk.body() if failed else chunk)}\n\n"
                    if failed:
                        return
                yield "data: [DONE]\n\n"
            finally:
                await _close(gen)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._respond(self._check(request, body.model), "completions", body)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._respond(self._check(request, body.model), "chat", body)

    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest, request: Request):
        return await self._respond(self._check(request, body.model), "embeddings", body)

    @api.get("/health")
    async def health(self):
        return {"status": "ok"}


def _deployment(cls: type) -> Deployment:
    """`serve.deployment(cls)` (typed: Serve's overloads read a bare class as decorator arguments)."""
    return cast(Deployment, serve.deployment(cls))


def _deployment_name(model_id: str) -> str:
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_.:-]", "-", model_id)


# Serve runs user code and handle routing on extra threads/loops by default; on small hosts each thread
# hop adds latency. These replicas keep everything on the replica's own event loop (the engine's model
# steps still run off-loop, in a worker thread or in the engine worker actors).
FAST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def _with_fast_path(actor_options: dict[str, Any]) -> dict[str, Any]:
    actor = dict(actor_options)
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**FAST_PATH_ENV, **(runtime_env.get("env_vars") or {})}
    actor["runtime_env"] = runtime_env
    return actor


def _server_options(config: LLMConfig) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "max_ongoing_requests": 1024,
        "health_check_period_s": 30,
        "health_check_timeout_s": 60,
    }
    opts.update(config.deployment_config)
    actor = dict(opts.get("ray_actor_options") or {})
    actor.setdefault("num_cpus", 0)  # the replica mostly waits on its engine workers
    if config.runtime_env:
        actor.setdefault("runtime_env", config.runtime_env)
    opts["ray_actor_options"] = _with_fast_path(actor)
    opts.setdefault("name", _deployment_name(config.model_id))
    return opts


def build_llm_deployment(llm_config: LLMConfig | dict, *, name_prefix: str | None = None):
    """One model as a Serve application (its handle serves `completions`, `chat`, `embeddings` ...)."""
    config = llm_config if isinstance(llm_config, LLMConfig) else LLMConfig.from_dict(llm_config)
    config.check_model_source()
    opts = _server_options(config)
    if name_prefix:
        opts["name"] = name_prefix + opts["name"]
    return _deployment(LLMServer).options(**opts).bind(config)


def build_openai_app(llm_serving_args: LLMServingArgs | dict):
    """The OpenAI-compatible application: `serve.run(build_openai_app(args))`.

    A one-model app is a single deployment named `LLMServer:<model_id>` (routes and engine in each
    replica); otherwise an `LLMRouter` ingress forwards to one `LLMServer:<model_id>` deployment per model
    (see `LLMServingArgs.single_deployment`).

    Every config is validated (topology, tensor_parallel_size, model directory) before anything starts.
    """
    args = (
        llm_serving_args
        if isinstance(llm_serving_args, LLMServingArgs)
        else LLMServingArgs(**llm_serving_args)
    )
    for config in args.llm_configs:
        config.check_model_source()
    model_ids = [c.model_id for c in args.llm_configs]
    mmls = [c.engine_kwargs.get("max_model_len") for c in args.llm_configs]
    if args.one_deployment:  # one deployment, named like the model's LLMServer, with the model's options
        (config,) = args.llm_configs
        ingress = _deployment(LLMRouter).options(**_server_options(config))
        return ingress.bind([config], model_ids, mmls, args.api_key)
    servers = [build_llm_deployment(c) for c in args.llm_configs]
    ingress_opts: dict[str, Any] = {"max_ongoing_requests": 2048, "ray_actor_options": {"num_cpus": 0}}
    ingress_opts.update(args.ingress_deployment_config)
    ingress_opts["ray_actor_options"] = _with_fast_path(ingress_opts.get("ray_actor_options") or {})
    ingress = _deployment(LLMRouter).options(name="LLMRouter", **ingress_opts)
    return ingress.bind(servers, model_ids, mmls, args.api_key)
