"""Requests both engines must answer the same way (issue 22, items 4 and 5; openai/checks.py's table):
(endpoint, fields on top of a valid request, the param the 400 names) and (endpoint, fields) honoured.
Bodies go out as JSON text with ASCII escapes, so a lone surrogate travels as `\\ud800`."""

from __future__ import annotations

import json
from typing import Any

MSG = [{"role": "user", "content": "x"}]
FIVE = ["a", "b", "c", "d", "e"]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

BAD_ON_BOTH = [
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat", {"messages": [*MSG, {"role": "", "content": "x"}]}, "messages.1.role"),
    ("tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat", {"messages": False}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [5]}, "messages.0"),
    ("completions", {"prompt": "a\ud800b"}, "prompt"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt.1"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.0.content.0.text"),
    ("chat", {"stop": "\udc00"}, "stop"),
    ("tokenize", {"prompt": "\ud800"}, "prompt"),
    ("detokenize", {"tokens": [1, 1.5]}, "tokens.1"),
    ("detokenize", {"tokens": ["5"]}, "tokens.0"),
    ("detokenize", {"tokens": [True]}, "tokens.0"),
    ("completions", {"stop": FIVE}, "stop"),
    ("chat", {"stop": FIVE}, "stop"),
    ("completions", {"seed": 2**70}, "seed"),
    ("chat", {"seed": -(2**70)}, "seed"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
]  # fmt: skip

OK_ON_BOTH = [
    ("completions", {"n": None, "stop": None, "seed": None, "temperature": None, "stream": None, "user": None}),
    ("completions", {"logprobs": None, "echo": None, "max_tokens": None, "top_p": None, "suffix": None}),
    ("chat", {"max_tokens": None, "n": None, "logprobs": None, "top_logprobs": None, "tool_choice": None}),
    ("chat", {"response_format": None, "stream_options": None, "seed": None, "stop": None, "tools": None}),
    ("chat", {"messages": [{"role": "developer", "content": "be brief"}, *MSG]}),
    ("chat", {"messages": [*MSG, {"role": "function", "name": "f", "content": "42"}]}),
    ("chat", {"messages": [*MSG, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]}),
    ("chat", {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"}]}, *MSG]}),
    ("chat", {"tools": [TOOL], "tool_choice": "none"}),
    ("completions", {"stop": FIVE[:4]}),
    ("completions", {"seed": 2**63 - 1}),
    ("chat", {"seed": -(2**63)}),
    ("completions", {"echo": True, "max_tokens": 0, "logprobs": 1}),
    ("detokenize", {"tokens": [1, 2]}),
    ("tokenize", {"prompt": "x", "add_special_tokens": None}),
]  # fmt: skip


def body(model: str, endpoint: str, fields: dict) -> dict:
    base: dict = {"model": model}
    if endpoint == "completions":
        base |= {"prompt": "x", "max_tokens": 2}
    elif endpoint == "chat":
        base |= {"messages": MSG, "max_tokens": 2}
    return base | fields


def ascii_json(obj: dict) -> bytes:
    return json.dumps(obj).encode()


ROUTES = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}


def check_answers_alike(http: Any, model: str) -> None:
    """Send BAD_ON_BOTH (streamed too where the endpoint streams) and OK_ON_BOTH to `model` through `http`
    (an httpx.Client on the app): each bad request a 400 naming its param, each good one a 200."""
    for endpoint, fields, param in BAD_ON_BOTH:
        for stream in (False, True) if endpoint in ("completions", "chat") else (False,):
            req = body(model, endpoint, fields) | ({"stream": True} if stream else {})
            r = http.post(ROUTES[endpoint], content=ascii_json(req))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    for endpoint, fields in OK_ON_BOTH:
        r = http.post(ROUTES[endpoint], content=ascii_json(body(model, endpoint, fields)))
        assert r.status_code == 200, (fields, r.text)
