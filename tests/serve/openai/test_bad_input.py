"""Malformed or unusual input (issue 22, items 4 and 5), in this process: the JSON bounds of the router
(size, nesting) on real bytes, and the embedded engine's answers to the requests both engines must answer
alike (_bad_requests.py; test_vllm.py sends the same list to vLLM, test_http_fuzz.py over HTTP to the
embedded engine, with malformed bodies)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from _bad_requests import BAD_ON_BOTH, MSG, OK_ON_BOTH, TOOL, body
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpuray.serve.llm.deployments.router import MAX_JSON_DEPTH, MAX_REQUEST_BYTES, json_depth_ok, read_json
from tpuray.serve.llm.openai.checks import vllm_only
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.protocol import ChatCompletionRequest, CompletionRequest


def _run(coro):
    return asyncio.run(coro)


async def _chunks(raw: bytes, size: int = 65536):
    for i in range(0, len(raw), size):
        yield raw[i : i + size]


def parsed(raw: bytes, length: str | None = None) -> dict:
    return _run(read_json(_chunks(raw), length))


def refused_json(raw: bytes, length: str | None = None) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parsed(raw, length)
    return e.value


def test_json_nesting_is_bounded_before_parsing():
    ok = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert json_depth_ok(ok) and parsed(ok)["a"]
    assert json_depth_ok(b'{"s": "[[[[{{{{\\"]]"}') and json_depth_ok(b"{}")
    for raw in (
        b"[" * 100_000,  # json.loads would raise RecursionError
        b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
        b'{"a": [}',
        b"[" * 5000 + b"{]",
    ):
        e = refused_json(raw)
        assert e.status == 400 and e.code == "invalid_json"
    start = time.perf_counter()
    assert refused_json(b"[" * (MAX_REQUEST_BYTES - 1)).status == 400  # near the limit: fast, off the loop
    assert time.perf_counter() - start < 5


def test_body_size_is_bounded_before_reading_it_all():
    e = refused_json(b"{}", str(MAX_REQUEST_BYTES + 1))  # the declared length alone
    assert e.status == 413 and e.code == "request_too_large"
    e = refused_json(b'{"prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}')  # no length header: counted
    assert e.status == 413
    for raw in (b"[1, 2]", b'"x"', b"\xff\xfe", b"{bad"):
        assert refused_json(raw).code == "invalid_json"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def answer(server, endpoint: str, fields: dict, stream: bool = False):
    """The response dict (the chunks when streamed) or the OpenAIError of a request."""
    req = json.loads(json.dumps(body("tiny", endpoint, fields)))  # a lone surrogate survives the round trip

    async def go():
        if stream:
            return [c async for c in server.handle_stream(endpoint, {**req, "stream": True})]
        return await server.handle(endpoint, req)

    try:
        return _run(go())
    except OpenAIError as e:
        return e


EMBEDDED_BAD = [
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content.0.type"),
    ("chat", {"messages": [{"role": "user", "content": ["x"]}]}, "messages.0.content.0"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]}, "messages.0.content.0.extra"),
    ("tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
    ("detokenize", {"tokens": [-1]}, "tokens"),
    ("tokenize", {"prompt": 5}, "prompt"),
    ("chat", {"tools": []}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": 5}}], "tool_choice": "none"}, "tools.0.function.name"),
    ("chat", {"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools.0.type"),
    ("chat", {"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    ("chat", {"tools": [TOOL]}, "tools"),  # tool_choice 'auto' (the default with tools) needs a tool parser
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"echo": True, "max_tokens": 0, "messages": [{"role": "assistant", "content": "x"}]}, "max_tokens"),
    ("completions", {"prompt": "word " * 100_000}, "prompt"),  # refused before tokenizing
    ("chat", {"messages": [{"role": "user", "content": "word " * 100_000}]}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"), BAD_ON_BOTH + EMBEDDED_BAD, ids=lambda x: str(x)[:40]
)
def test_bad_requests_are_400s_naming_the_param(server, endpoint, fields, param):
    for stream in (False, True) if endpoint in ("completions", "chat") else (False,):
        e = answer(server, endpoint, fields, stream)
        assert isinstance(e, OpenAIError), (fields, e)
        assert e.status == 400 and e.param == param, (fields, e.body())


@pytest.mark.parametrize(("endpoint", "fields"), OK_ON_BOTH, ids=lambda x: str(x)[:40])
def test_honoured_on_both_engines(server, endpoint, fields):
    result = answer(server, endpoint, fields)
    assert isinstance(result, dict), (fields, result)
    if endpoint in ("completions", "chat"):
        assert result["choices"] and result["usage"]["prompt_tokens"] > 0


def test_echo_with_max_tokens_0_is_the_prompt_and_its_logprobs(server):
    fields = {"prompt": "Hello world", "echo": True, "max_tokens": 0, "logprobs": 1}
    result = answer(server, "completions", fields)
    n_prompt = len(server.engine.encode_prompt("Hello world"))
    (choice,) = result["choices"]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt and lp["token_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    chunks = answer(server, "completions", fields, stream=True)
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == "Hello world"
    assert [t for ch in chunks for c in ch["choices"] for t in c["logprobs"]["tokens"]] == lp["tokens"]


def test_roles_nulls_and_tools_reach_the_chat_template(server):
    messages = [{"role": "function", "name": "f", "content": "42"}, *MSG]
    tokens = answer(server, "tokenize", {"messages": messages, "model": None})["tokens"]
    assert "<|im_start|>function\n42<|im_end|>" in server.engine.tokenizer.decode(tokens)
    with_tools = answer(server, "chat", {"tools": [TOOL], "tool_choice": "none", "temperature": 0})
    plain = answer(server, "chat", {"temperature": 0, "tools": None, "n": None})
    # the tiny model's template ignores tools: the same prompt, the same greedy reply
    assert with_tools["usage"] == plain["usage"]
    assert with_tools["choices"][0]["message"] == plain["choices"][0]["message"]


def test_a_huge_prompt_is_refused_fast_and_does_not_stall_others(server):
    async def go() -> tuple[float, float, OpenAIError | None]:
        start = time.perf_counter()
        huge = server.handle("completions", body("tiny", "completions", {"prompt": "a b " * 1_000_000}))
        small = server.handle("completions", body("tiny", "completions", {}))
        results = await asyncio.gather(huge, small, return_exceptions=True)
        assert isinstance(results[1], dict)
        return time.perf_counter() - start, 0.0, results[0] if isinstance(results[0], OpenAIError) else None

    elapsed, _, error = _run(go())
    assert error is not None and error.param == "prompt" and error.code == "context_length_exceeded"
    assert elapsed < 5
    # a long prompt that may fit is tokenized in a worker thread (and then refused on its token count)
    e = answer(server, "completions", {"prompt": "ab" * (server.max_prompt_chars // 2)})
    assert isinstance(e, OpenAIError) and e.code == "context_length_exceeded"


# -- fuzz: whatever the JSON, the answer is a response or an OpenAIError (never another exception) ----------

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=4)
    | st.sampled_from(["\ud800", "text", "none", "auto", "json_object", "user", "function", "-1"])
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_FIXED = {"model", "n", "max_tokens", "max_completion_tokens", "min_tokens", "best_of", "ignore_eos"}


def _fields(cls, endpoint: str) -> list[str]:
    return sorted(set(cls.model_fields) | set(vllm_only(endpoint)) - _FIXED)


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    endpoint=st.sampled_from(["completions", "chat", "tokenize", "detokenize"]),
    data=st.data(),
)
def test_fuzzed_fields_never_raise_anything_but_openai_errors(server, endpoint, data):
    names = {
        "completions": _fields(CompletionRequest, "completions"),
        "chat": _fields(ChatCompletionRequest, "chat") + ["messages"],
        "tokenize": [
            "prompt",
            "messages",
            "add_special_tokens",
            "add_generation_prompt",
            "return_token_strs",
        ],
        "detokenize": ["tokens"],
    }[endpoint]
    extra = data.draw(st.dictionaries(st.sampled_from(names), _JSON, max_size=3))
    if endpoint == "chat" and data.draw(st.booleans()):  # messages with fuzzed parts
        message = data.draw(st.dictionaries(st.sampled_from(["role", "content", "name"]), _JSON, max_size=3))
        extra["messages"] = [message]
    stream = endpoint in ("completions", "chat") and data.draw(st.booleans())
    result = answer(server, endpoint, extra, stream)
    if isinstance(result, OpenAIError):
        assert result.status in (400, 404), result.body()
