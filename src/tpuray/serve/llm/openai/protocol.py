"""The OpenAI protocol as tpuray's embedded engine reads it: request models (pydantic, strict types and
OpenAI's and vLLM's bounds), `parse_request`, and the helpers responses are built with (ids, usage, the
model card). A parse failure is a 400 naming the field (errors.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpuray.serve.llm.engine.embedded import fields
from tpuray.serve.llm.openai.errors import OpenAIError, error_from_validation

logger = logging.getLogger(__name__)


StopT = str | list[str] | None
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LOGPROBS_MAX = 20  # vLLM's default max_logprobs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_matches_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {name, schema}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only valid with type 'json_schema', not {self.type!r}")
        return self


class _Request(BaseModel):
    """Fields common to completions and chat. Strict types: a boolean is not "maybe", an integer is not
    0.5. Fields OpenAI defines that this engine cannot honour are refused (UNSUPPORTED); fields vLLM
    defines that only vLLM honours are refused with a pointer to llm_engine='vLLM' (VLLM_ONLY); both
    tables are in engine/embedded/fields.py. Other unknown fields are accepted and logged as ignored, as
    vLLM does."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions with echo only (the prompt alone)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopT = None
    seed: int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    request_id: str | None = None  # vLLM: the response id is cmpl-<request_id> / chatcmpl-<request_id>

    UNSUPPORTED: ClassVar[dict[str, str]] = {}
    VLLM_ONLY: ClassVar[dict[str, tuple[Any, str]]] = fields.REQUEST_VLLM_ONLY

    @model_validator(mode="after")
    def _checks(self) -> _Request:
        for name, why in self.UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and value is not False and value != []:
                raise OpenAIError(f"'{name}' is not supported by the embedded engine: {why}", param=name)
        extra = dict(self.model_extra or {})
        for name, (default, why) in self.VLLM_ONLY.items():
            if name in extra and extra.pop(name) != default:
                raise OpenAIError(
                    f"'{name}' is supported with llm_engine='vLLM', not by the embedded engine: {why}",
                    param=name,
                )
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")
        if extra:
            logger.warning("The following fields were present in the request but ignored: %s", sorted(extra))
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=LOGPROBS_MAX)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (e.g. BOS) around a text prompt

    UNSUPPORTED: ClassVar[dict[str, str]] = fields.COMPLETION_UNSUPPORTED
    VLLM_ONLY: ClassVar[dict[str, tuple[Any, str]]] = fields.COMPLETION_VLLM_ONLY

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(
                "'max_tokens' must be at least 1 (0, the prompt alone, only with echo)", param="max_tokens"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(
                f"best_of={self.best_of} is not supported by the embedded engine (valid: best_of == n, "
                f"{self.n}); {fields.NOT_IMPLEMENTED}",
                param="best_of",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x for x in p if isinstance(x, (str, list))]


class TextPart(BaseModel):
    """A content part of a chat message: the served models read text parts only."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


def check_content_parts(messages: Any) -> None:
    """A 400 naming the first content part of `messages` (raw JSON) that is not a text part."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            where = f"messages.{i}.content.{j}"
            if not isinstance(part, dict):
                raise OpenAIError(f"'{where}' must be a content part object, got {part!r}", param=where)
            if part.get("type") != "text":
                raise OpenAIError(
                    f"content part type {part.get('type')!r} is not supported by the embedded engine (the "
                    "served models are text-only); valid: 'text'",
                    param=f"{where}.type",
                )
            if not isinstance(part.get("text"), str):
                raise OpenAIError(
                    f"'{where}.text' must be a string, got {part.get('text')!r}", param=f"{where}.text"
                )
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise OpenAIError(
                    f"'{where}.{extra[0]}' is not a field of a text content part", param=f"{where}.{extra[0]}"
                )


class _ChecksContentParts(BaseModel):
    """A request with chat `messages`: their content parts are checked first (check_content_parts)."""

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_content_parts(data.get("messages"))
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # OpenAI's roles (checks.ROLES names a bad one first, on both engines)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # handed to the chat template with the message (as vLLM does)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


def template_messages(messages: Iterable[ChatMessage]) -> list[dict[str, str]]:
    """Chat messages as the chat template sees them: role (developer -> system), text content, and `name`
    when the message has one (as vLLM hands it to `apply_chat_template`)."""
    out = []
    for m in messages:
        message = {"role": m.role if m.role != "developer" else "system", "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(_Request, _ChecksContentParts):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=LOGPROBS_MAX)
    tools: list[Tool] | None = Field(default=None, min_length=1)  # with tool_choice 'none': to the template
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    # vLLM's chat parameters
    echo: bool = False  # the reply starts with the last message's content when it has the reply's role
    add_generation_prompt: bool | None = None  # None: true unless continue_final_message
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, str]] = fields.CHAT_UNSUPPORTED
    VLLM_ONLY: ClassVar[dict[str, tuple[Any, str]]] = fields.CHAT_VLLM_ONLY

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.tools is not None and self.tool_choice != "none":
            raise OpenAIError(
                f"tools with tool_choice={self.tool_choice or 'auto'!r} need a tool parser, which the embedded "
                f"engine does not have (valid: tool_choice 'none': the tools reach the chat template and no "
                f"call is parsed); {fields.NOT_IMPLEMENTED}",
                param="tools",
            )
        if self.tool_choice not in (None, "none"):
            raise OpenAIError(
                f"tool_choice={self.tool_choice!r} is not supported by the embedded engine (valid: 'none'); "
                f"{fields.NOT_IMPLEMENTED}",
                param="tool_choice",
            )
        if self.modalities not in (None, ["text"]):
            raise OpenAIError(
                f"modalities={self.modalities!r}: the served models are text-only; valid: ['text']",
                param="modalities",
            )
        if self.service_tier not in (None, "auto", "default"):
            raise OpenAIError(
                f"service_tier={self.service_tier!r}: there is one tier here; valid: 'auto', 'default'",
                param="service_tier",
            )
        if self.max_tokens == 0:
            raise OpenAIError("'max_tokens' must be at least 1", param="max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        return self

    @property
    def generation_prompt(self) -> bool:
        """Whether the chat template opens a new assistant turn (vLLM's add_generation_prompt)."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    def reply_role(self) -> str:
        """The role of the reply: the assistant's, or (without a generation prompt) the last message's."""
        return "assistant" if self.generation_prompt else self.messages[-1].role


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


class TokenizeRequest(_ChecksContentParts):
    """vLLM's /tokenize: a completion prompt or chat messages."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="forbid", strict=True)

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
