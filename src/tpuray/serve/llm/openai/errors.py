"""Errors as OpenAI's clients read them: `{"error": {"message", "type", "param", "code"}}` with an HTTP
status. Validation failures (malformed JSON, missing fields, bad types) are 400s naming the field, like
OpenAI's, not FastAPI's default 422; an engine's death is the one 503 (`engine_dead_error`).
"""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An error returned to the client in OpenAI's format with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # picklable across Ray with all fields
        return (OpenAIError, (self.message, self.status, self.type, self.param, self.code))


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


def engine_dead_error(model_id: str, cause: BaseException) -> OpenAIError:
    """What a client gets when the engine of its model died (or the model's replica, behind a router):
    503, retry (Serve is replacing the replica)."""
    return OpenAIError(
        f"model `{model_id}` is unavailable: its engine died ({type(cause).__name__}: {cause}); Serve is "
        "replacing its replica (or it moved off a preempted slice), retry shortly",
        503,
        type="service_unavailable",
        code="engine_dead",
    )
