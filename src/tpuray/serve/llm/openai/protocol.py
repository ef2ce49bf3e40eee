"""The OpenAI protocol as tpuray's embedded engine reads it: request models (pydantic, strict types and
OpenAI's and vLLM's bounds), `parse_request`, and the helpers responses are built with (ids, usage, the
model card). A parse failure is a 400 naming the field (errors.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpuray.serve.llm.openai.errors import error_from_validation

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
    0.5. Unknown fields are kept (`model_extra`): what the embedded engine refuses, honours or ignores
    among them, and among the fields here, is checks.py's FIELDS."""

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


class ChatCompletionRequest(_Request):
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


class TokenizeRequest(BaseModel):
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
