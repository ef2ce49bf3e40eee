"""Logprobs have one entry per token (issue 22, item 3): completions (with and without echo) and chat,
streamed and not, on the embedded engine in this process (real engine, byte-level BPE tokenizer). A token
that is an incomplete UTF-8 sequence is written `bytes:\\xNN` (chat: its raw `bytes`), so the entries'
bytes concatenate to the text's bytes, and their strings to the text wherever it is valid UTF-8."""

from __future__ import annotations

import asyncio
import codecs

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpuray.serve.llm.openai.logprobs import BYTES_PREFIX, _byte_level_alphabet, string_bytes, token_string

# multi-byte characters: their bytes are separate tokens of the tiny model's byte-level BPE
WIDE = "é’€日本😀"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def _run(coro):
    return asyncio.run(coro)


def byte_token_ids(server, text: str) -> list[int]:
    """The ids of the single-byte tokens of `text`'s UTF-8 bytes."""
    chars = {b: c for c, b in _byte_level_alphabet().items()}
    ids = server.engine.tokenizer.convert_tokens_to_ids([chars[b] for b in sorted(set(text.encode()))])
    assert all(isinstance(i, int) and i >= 0 for i in ids)
    return ids


def joined(tokens: list[str]) -> str:
    """The text the token strings stand for: their bytes concatenated, decoded as the engine decodes."""
    return b"".join(string_bytes(t) for t in tokens).decode("utf-8", errors="replace")


def check_completion(choice: dict, usage: dict, prompt: str | None, n_prompt: int) -> None:
    lp, text = choice["logprobs"], choice["text"]
    n = usage["completion_tokens"] + n_prompt
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert len(lp["text_offset"]) == n
    assert joined(lp["tokens"]) == text
    if not any(t.startswith(BYTES_PREFIX) for t in lp["tokens"]):
        assert "".join(lp["tokens"]) == text
    for token, start in zip(lp["tokens"], lp["text_offset"], strict=True):  # a valid token sits at its offset
        if not token.startswith(BYTES_PREFIX) and "\ufffd" not in text[: start + len(token)]:
            assert text[start : start + len(token)] == token
    assert lp["text_offset"] == sorted(lp["text_offset"])
    if prompt is not None:
        assert text.startswith(prompt) and joined(lp["tokens"][:n_prompt]) == prompt


def streamed(server, endpoint: str, body: dict) -> tuple[list[dict], dict]:
    async def go() -> tuple[list[dict], dict]:
        body_ = {**body, "stream": True, "stream_options": {"include_usage": True}}
        chunks = [c async for c in server.handle_stream(endpoint, body_)]
        return chunks[:-1], chunks[-1]["usage"]

    return _run(go())


def merge_completion_chunks(chunks: list[dict]) -> dict:
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for c in chunk["choices"]:
            text += c["text"]
            for k in lp:
                lp[k] += c["logprobs"][k]
    return {"text": text, "logprobs": lp}


def test_token_strings_round_trip():
    assert token_string("é".encode()) == "é"
    assert token_string(b"\xe2\x82") == "bytes:\\xe2\\x82"
    assert string_bytes("bytes:\\xe2\\x82") == b"\xe2\x82" and string_bytes("é") == "é".encode()


def test_partial_utf8_tokens_each_get_an_entry(server):
    """The issue's case: 8 tokens, 8 entries, when the sampled tokens are bytes of multi-byte chars."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "logprobs": 2, "seed": 3}
    body["allowed_token_ids"] = byte_token_ids(server, "€")
    result = _run(server.handle("completions", body))
    assert result["usage"]["completion_tokens"] == 8
    check_completion(result["choices"][0], result["usage"], None, 0)
    assert all(t.startswith(BYTES_PREFIX) or t == "€" for t in result["choices"][0]["logprobs"]["tokens"])
    chunks, usage = streamed(server, "completions", body)
    assert usage == result["usage"]
    merged = merge_completion_chunks(chunks)
    assert merged == {k: result["choices"][0][k] for k in ("text", "logprobs")}


@settings(
    max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=st.text(alphabet=st.sampled_from("ab Hello?" + WIDE), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
    max_tokens=st.integers(1, 10),
    echo=st.booleans(),
    bytes_only=st.booleans(),
)
def test_one_entry_per_token_property(server, prompt, seed, max_tokens, echo, bytes_only):
    body: dict = {"model": "tiny", "max_tokens": max_tokens, "seed": seed, "skip_special_tokens": False}
    if bytes_only:  # sample only bytes of multi-byte characters: many tokens are incomplete UTF-8
        body["allowed_token_ids"] = byte_token_ids(server, WIDE)
    completion = {**body, "prompt": prompt, "logprobs": 1, "echo": echo}
    result = _run(server.handle("completions", completion))
    n_prompt = len(server.engine.encode_prompt(prompt)) if echo else 0
    (choice,) = result["choices"]
    check_completion(choice, result["usage"], prompt if echo else None, n_prompt)
    chunks, usage = streamed(server, "completions", completion)
    assert usage == result["usage"]
    assert merge_completion_chunks(chunks) == {k: choice[k] for k in ("text", "logprobs")}

    chat = {**body, "messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 1}
    result = _run(server.handle("chat", chat))
    content, text = result["choices"][0]["logprobs"]["content"], result["choices"][0]["message"]["content"]
    assert len(content) == result["usage"]["completion_tokens"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace") == text
    for e in content:
        assert string_bytes(e["token"]) == bytes(e["bytes"])
        assert all(string_bytes(t["token"]) == bytes(t["bytes"]) for t in e["top_logprobs"])
    chunks, usage = streamed(server, "chat", chat)
    streamed_content = [
        e for c in chunks for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content", [])
    ]
    assert streamed_content == content and usage == result["usage"]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    assert (
        "".join(decoder.decode(bytes(e["bytes"])) for e in content) + decoder.decode(b"", final=True) == text
    )
