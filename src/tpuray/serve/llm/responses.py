"""OpenAI logprobs objects from the engine's (token, logprob, top-n) records.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with echo the prompt's tokens
come first; the first prompt token has no logprob, as in OpenAI's API). Chat: `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}], "refusal": None}`. Token strings are each token decoded on
its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpuray.serve.llm.engine.logits import TokenLogprobs


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> its text (decoded once)

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def completion(
        self,
        records: Sequence[TokenLogprobs],
        offset: int = 0,
        prompt_ids: list[int] | None = None,
        prompt_records: Sequence[TokenLogprobs] | None = None,
    ) -> tuple[dict[str, Any], int]:
        """(logprobs object, text offset after these tokens)."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []

        def add(token: int, value: float | None, top: dict[str, float] | None) -> None:
            nonlocal offset
            text = self.text(token)
            tokens.append(text)
            values.append(value)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)

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
            "text_offset": offsets,
        }, offset

    def _entry(self, token: int, value: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    def chat(self, records: Sequence[TokenLogprobs]) -> dict[str, Any]:
        content = [
            {**self._entry(token, value), "top_logprobs": [self._entry(t, v) for t, v in top]}
            for token, value, top in records
        ]
        return {"content": content, "refusal": None}
