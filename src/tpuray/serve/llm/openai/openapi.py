"""The OpenAPI document of the OpenAI app (`/openapi.json`): the real request and response models.

The routes read their JSON bodies themselves (size and nesting bounded before parsing, then each
backend's strict protocol: checks.py, protocol.py, backends/vllm.py), so FastAPI never parses or
validates a body and never answers 422: bad input is an OpenAI-style 400 naming the param. The request
models are tpuray's protocol classes (types, bounds, required fields), written into the document here;
the response models below are documentation only (responses are built as dicts by the backends; vLLM's
may carry more fields, hence `extra="allow"`). `/metrics` is Prometheus text.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from tpuray.serve.llm.openai import protocol

REF = "#/components/schemas/{model}"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Doc):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Embedding(_Doc):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: encoding_format "base64" (little-endian float32)


class EmbeddingResponse(_Doc):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class TokenizeResponse(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Doc):
    prompt: str


# A model's state: its engine serves (or, moving off a preempted slice, holds requests for the new one),
# died and a new one is starting in its replica (requests get a 503 with Retry-After), or its replica does
# not answer (a model served by a deployment of its own).
ModelState = Literal["serving", "recovering", "unavailable"]


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    status: ModelState


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "degraded", "unavailable"]  # every model serving, some, none
    models: dict[str, ModelState]


SSE = {
    "text/event-stream": {
        "schema": {"type": "string"},
        "description": "with stream: true, `data: <chunk JSON>` events, then `data: [DONE]`",
    }
}
# path -> (request model, response model, streams)
POST_ROUTES: dict[str, tuple[type[BaseModel], type[BaseModel], bool]] = {
    "/v1/completions": (protocol.CompletionRequest, CompletionResponse, True),
    "/v1/chat/completions": (protocol.ChatCompletionRequest, ChatCompletionResponse, True),
    "/v1/embeddings": (protocol.EmbeddingRequest, EmbeddingResponse, False),
    "/tokenize": (protocol.TokenizeRequest, TokenizeResponse, False),
    "/detokenize": (protocol.DetokenizeRequest, DetokenizeResponse, False),
}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request: `param` names the field"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    503: {
        "model": ErrorResponse,
        "description": "the model's engine died and a new one is starting: retry after `Retry-After` seconds",
    },
}
HEALTH_DOCS: dict[str, Any] = {
    "responses": {
        200: {"model": Health, "description": "every model serves (`ok`) or some do (`degraded`)"},
        503: {"model": Health, "description": "no model serves now; `Retry-After`: when to look again"},
    }
}


def post_docs(path: str) -> dict[str, Any]:
    """The keyword arguments of a POST route's decorator that document its responses."""
    _, response, streams = POST_ROUTES[path]
    ok: dict[str, Any] = {"model": response, "description": "the response"}
    if streams:
        ok["content"] = SSE
    return {"responses": {200: ok, **ERRORS}}


def get_docs(response: type[BaseModel], *errors: int) -> dict[str, Any]:
    return {"responses": {200: {"model": response}, **{e: ERRORS[e] for e in errors}}}


METRICS_DOCS: dict[str, Any] = {
    "responses": {
        200: {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    }
}


# Realistic values for the request fields a schema-driven client must fill (schemathesis, Swagger UI).
EXAMPLES: dict[str, list[Any]] = {
    "prompt": ["Hello, my name is"],
    "messages": [[{"role": "user", "content": "Say hello in one sentence."}]],
    "input": ["The quick brown fox jumps over the lazy dog."],
    "tokens": [[9906, 11, 1917]],
}


def openapi_document(app: FastAPI, model_ids: list[str] | None = None) -> dict[str, Any]:
    """FastAPI's document with each POST route's request body: its protocol model, required JSON. With
    the served `model_ids`, a request's `model` is one of them (an enum, so that schema-driven tools send
    served models) and its prompt fields carry realistic examples."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, (request, _, _) in POST_ROUTES.items():
        schema = request.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[request.__name__] = _with_examples(schema, model_ids)
        op = doc["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=request.__name__)}}},
        }
    for item in doc["paths"].values():  # no 422: validation errors are OpenAI 400s (deployments/router.py)
        for op in item.values():
            if op.get("responses", {}).pop("422", None) is not None:
                op["responses"].setdefault("400", {"description": "invalid request"})
                op["responses"]["400"]["content"] = {
                    "application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}
                }
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error = ErrorResponse.model_json_schema(ref_template=REF)
    schemas.update(error.pop("$defs", {}))
    schemas.setdefault("ErrorResponse", error)
    app.openapi_schema = doc
    return doc


def _with_examples(schema: dict[str, Any], model_ids: list[str] | None) -> dict[str, Any]:
    """A request schema with the served models as `model`'s values and EXAMPLES on its fields."""
    props = schema.get("properties", {})
    for name, examples in EXAMPLES.items():
        if name in props:
            props[name]["examples"] = examples
    if model_ids and "model" in props:
        served = {"type": "string", "enum": list(model_ids), "examples": [model_ids[0]]}
        optional = "anyOf" in props["model"]  # /tokenize, /detokenize: the only model when left out
        props["model"] = {
            **({"anyOf": [served, {"type": "null"}], "default": None} if optional else served),
            "title": "Model",
            "description": "a served model's id (GET /v1/models)",
        }
    return schema
