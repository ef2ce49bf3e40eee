"""OpenAI logprobs objects from the engine's (token, logprob, top-n) records.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with echo the prompt's tokens
come first; the first prompt token has no logprob, as in OpenAI's API). Chat: `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}], "refusal": None}`.

One entry per token, always. A token's string is the token decoded on its own; a token whose bytes are not
valid UTF-8 on their own (a byte-level BPE or byte-fallback piece of a multi-byte character) is written as
OpenAI writes it, `bytes:\\xNN...` (each of its bytes escaped), and chat's `bytes` holds its raw bytes, so
the entries' bytes concatenate to the text's. `text_offset` is the character offset in the text where the
token's bytes start (a token inside a character gets that character's offset).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from functools import cache
from typing import Any

from tpuray.serve.llm.generation import TokenLogprobs

BYTES_PREFIX = "bytes:"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_string(raw: bytes) -> str:
    """A token's string in logprobs: its text when its bytes are valid UTF-8, else `bytes:\\xNN...`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


def string_bytes(token: str) -> bytes:
    """The bytes a logprobs token string stands for (the inverse of token_string)."""
    if token.startswith(BYTES_PREFIX):
        hexes = token[len(BYTES_PREFIX) :].split("\\x")[1:]
        return bytes(int(h, 16) for h in hexes)
    return token.encode("utf-8")


class TextOffsets:
    """Character offsets of a choice's tokens in its text, fed token bytes in order (across stream
    chunks): a UTF-8 decoder that holds an incomplete character back, as the text does."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, raw: bytes) -> int:
        """The offset of the next token, whose bytes are `raw`."""
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._tokens: dict[int, tuple[str, bytes]] = {}  # token id -> (its string, its bytes), made once

    def token(self, token: int) -> tuple[str, bytes]:
        """(string for logprobs, raw bytes) of a token id."""
        known = self._tokens.get(token)
        if known is None:
            known = self._tokens[token] = self._make(token)
        return known

    def text(self, token: int) -> str:
        return self.token(token)[0]

    def _make(self, token: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token])
        if "\ufffd" not in text:
            return text, text.encode("utf-8")
        raw = self._raw_bytes(token)
        return (token_string(raw), raw) if raw is not None else (text, text.encode("utf-8"))

    def _raw_bytes(self, token: int) -> bytes | None:
        """A token's bytes from its vocabulary entry: byte-level BPE (GPT-2's alphabet) or a byte-fallback
        piece (`<0xNN>`); None for any other tokenizer."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return None
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return None

    def completion(
        self,
        records: Sequence[TokenLogprobs],
        offsets: TextOffsets | None = None,
        prompt_ids: list[int] | None = None,
        prompt_records: Sequence[TokenLogprobs] | None = None,
    ) -> tuple[dict[str, Any], TextOffsets]:
        """(logprobs object, the offsets state after these tokens: pass it with the next chunk)."""
        offsets = offsets if offsets is not None else TextOffsets()
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        starts: list[int] = []

        def add(token: int, value: float | None, top: dict[str, float] | None) -> None:
            text, raw = self.token(token)
            tokens.append(text)
            values.append(value)
            tops.append(top)
            starts.append(offsets.add(raw))

        if prompt_ids is not None:
            add(prompt_ids[0], None, None)
            for token, value, top in prompt_records or []:
                add(token, value, {self.text(t): v for t, v in top})
        for token, value, top in records:
            add(token, value, {self.text(t): v for t, v in top})
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": starts,
        }, offsets

    def _entry(self, token: int, value: float) -> dict[str, Any]:
        text, raw = self.token(token)
        return {"token": text, "logprob": value, "bytes": list(raw)}

    def chat(self, records: Sequence[TokenLogprobs]) -> dict[str, Any]:
        content = [
            {**self._entry(token, value), "top_logprobs": [self._entry(t, v) for t, v in top]}
            for token, value, top in records
        ]
        return {"content": content, "refusal": None}
