"""Errors as OpenAI's clients read them: `{"error": {"message", "type", "param", "code"}}` with an HTTP
status. Validation failures (malformed JSON, missing fields, bad types) are 400s naming the field, like
OpenAI's, not FastAPI's default 422; an engine's death is the one 503 (`engine_dead_error`), with a
`Retry-After` header. The app's error handlers, and the one function that turns an error into a response
(`error_response`), are here too (`add_error_handlers`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # a dead engine's Retry-After when nothing better is known (seconds)


class OpenAIError(Exception):
    """An error returned to the client in OpenAI's format with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.retry_after_s = retry_after_s  # the response's Retry-After header (a 503's), when set

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # picklable across Ray with all fields
        return (
            OpenAIError,
            (self.message, self.status, self.type, self.param, self.code, self.retry_after_s),
        )


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _param(loc: tuple) -> str | None:
    """The request field a pydantic error location names: `stream_options.include_usage`, without
    pydantic's union-member tags (`prompt.list[int]` -> `prompt`)."""
    parts = []
    for p in loc:
        if p == "body":
            continue
        if not isinstance(p, str):  # a list index: messages.0.role
            parts.append(str(p))
            continue
        if "[" in p or p.split("-")[0] in _TYPE_TAGS or p.startswith(("function-", "json-")):
            continue
        parts.append(p)
    return ".".join(parts) or None


def error_from_validation(errors: list[dict[str, Any]]) -> OpenAIError:
    """Map pydantic/FastAPI validation errors to one OpenAI 400 error naming the first bad field."""
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return OpenAIError(
            f"request body is not valid JSON: {first.get('msg', '')}", param=None, code="invalid_json"
        )
    msg = first.get("msg", "invalid value")
    if "input" in first and first.get("type") != "missing":
        msg = f"{msg} (got {first['input']!r})"
    return OpenAIError(
        f"invalid value for '{param}': {msg}" if param else msg, param=param, code="invalid_value"
    )


def engine_dead_error(model_id: str, cause: BaseException, retry_after_s: int = RETRY_AFTER_S) -> OpenAIError:
    """What a client gets when the engine of its model died (or the model's replica, behind a router):
    503 with `Retry-After`; the replica is starting a new engine (deployments/failover.py)."""
    return OpenAIError(
        f"model `{model_id}` is unavailable: its engine died ({type(cause).__name__}: {cause}); a new "
        f"engine is starting, retry in {retry_after_s} s",
        503,
        type="service_unavailable",
        code="engine_dead",
        retry_after_s=retry_after_s,
    )


# -- responses and the app's handlers --------------------------------------------------------------------


def error_response(e: OpenAIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


async def openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc)


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own parameter validation answers like the routes do: a 400 naming the param, not 422."""
    assert isinstance(exc, RequestValidationError)
    where = ("path", "query", "header", "cookie")  # the param is the field itself, not where it came from
    errors = [{**e, "loc": tuple(p for p in e.get("loc", ()) if p not in where)} for e in exc.errors()]
    return error_response(error_from_validation(errors))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed")
    return error_response(
        OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500, type="internal_error")
    )


def add_error_handlers(app: FastAPI) -> None:
    """Every error of `app` answered in OpenAI's format: OpenAIErrors, FastAPI's validation, the rest (500)."""
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
