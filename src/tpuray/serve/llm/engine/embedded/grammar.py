"""Token-level constrained decoding for `response_format` (json_object, json_schema) with llguidance.

llguidance (vLLM's own "guidance" structured-output backend, installed with vLLM) compiles a JSON schema
into a grammar once, and a matcher per sequence fills a bitmask of the tokens allowed next; the engine
masks the logits with it before sampling and feeds the sampled token back. A sequence whose grammar is
complete can only stop. (llguidance was chosen over xgrammar, vLLM's default backend, because here
xgrammar 0.2.9 lets raw control characters into JSON strings, which strict JSON parsers reject:
docs/serve.md.)
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch

from tpuray.optional import require

JSON_OBJECT = {"type": "object"}  # what vLLM compiles for response_format json_object


class GrammarError(ValueError):
    """The response_format cannot be compiled (the message says why)."""


class Grammars:
    """One engine's grammar compiler: its tokenizer's llguidance view, compiled grammars, matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        llg = require("llguidance", "vllm", "response_format json_object / json_schema")
        import llguidance.hf

        self.llg = llg
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids)
        )
        self.executor = llg.LLExecutor(num_threads=2)
        self._compiled = lru_cache(maxsize=64)(self._compile)

    def _compile(self, schema_json: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema_json, defaults={"whitespace_flexible": True}
        )
        err = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise GrammarError(err)
        return grammar

    def compile(self, schema: dict[str, Any] | None) -> Any:
        """The grammar of a JSON schema (None: any JSON object). GrammarError when it cannot compile."""
        text = json.dumps(JSON_OBJECT if schema is None else schema, sort_keys=True)
        return self._compiled(text)

    def matcher(self, grammar: Any) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=1)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m

    def bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """[len(matchers), ceil(V/32)] int32: row i allows what matchers[i] allows next."""
        mask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), mask.shape[1] * 4, mask.shape[0]
        )
        return mask


def accept(matcher: Any, token: int) -> bool:
    """Feed the sampled token; False if the grammar refused it (never when the mask was applied)."""
    return bool(matcher.consume_token(token))


def finished(matcher: Any) -> bool:
    """Nothing but a stop token can follow (the JSON is complete)."""
    return bool(matcher.is_stopped())
