"""OpenAI wire format: request schemas (pydantic), response builders and the JSON error format.

Errors always have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; validation failures
(malformed JSON, missing fields, bad types) are 400 like OpenAI, not FastAPI's default 422.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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


def error_from_validation(errors: list[dict[str, Any]]) -> OpenAIError:
    """Map pydantic/FastAPI validation errors to one OpenAI 400 error naming the first bad field."""
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
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


StopT = str | list[str] | None


class _Request(BaseModel):
    # Unknown OpenAI fields (user, logit_bias, ...) are accepted and ignored, like vLLM does.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stop: StopT = None
    seed: int | None = None
    stream_options: dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x for x in p if isinstance(x, (str, list))]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise OpenAIError(
                    f"content part type {part.get('type')!r} is not supported; valid: 'text'",
                    param="messages",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt or chat messages."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def parse_request(cls: type[BaseModel], body: dict[str, Any]) -> Any:
    """`cls` from a JSON body; a validation error is a 400 OpenAIError naming the first bad field."""
    from pydantic import ValidationError

    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise error_from_validation([dict(x) for x in e.errors()]) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(model_id: str, created: int, max_model_len: int | None = None) -> dict[str, Any]:
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "tpuray"}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return card


def now() -> int:
    return int(time.time())
