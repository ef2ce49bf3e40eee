"""Engines behind an LLM deployment: vLLM (vllm_engine.py, with vLLM's own OpenAI layer) where it is
installed, else the embedded PyTorch engine (embedded.py). `LLMConfig.engine` says which one a model gets.

The embedded engine's interface, used by `tpuray.serve.llm.server.ModelServer`: `tokenizer`,
`max_model_len`, `encode_prompt(prompt)`, `apply_chat_template(messages)`,
`generate(prompt_ids, SamplingParams, index) -> AsyncIterator[SeqOutput]`, `describe()`, `shutdown()`.
"""

from __future__ import annotations

import importlib.util


def vllm_available() -> bool:
    """vLLM is installed in this environment (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None
