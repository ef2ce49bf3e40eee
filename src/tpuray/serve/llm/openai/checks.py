"""What tpuray refuses (or reads as unset) on every engine, before an engine's own protocol parses a request.

The router bounds the request before it is parsed (`read_json`): its size (MAX_REQUEST_BYTES, 413) and its
JSON nesting (MAX_JSON_DEPTH, checked before json.loads could recurse that deep), parsing a large body off
the event loop. Each backend then applies `check_body` (the same rules for vLLM and the embedded engine),
so both engines give the same answer wherever both can honour a field:

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
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from tpuray.serve.llm.openai.errors import OpenAIError

MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a request body larger than this is refused unread (413)
MAX_JSON_DEPTH = 64  # arrays / objects nested deeper are refused before parsing
OFF_LOOP_BYTES = 64 * 1024  # bodies larger than this are parsed in a worker thread
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's ("function": deprecated)
MAX_STOP = 4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but brackets (to delete)
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")
_SURROGATE = re.compile("[\ud800-\udfff]")


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
