"""Engines behind an LLM deployment: vLLM when it is installed, else the embedded PyTorch engine.

Both expose the same small interface used by `tpuray.serve.llm.server.ModelServer`:
`tokenizer`, `max_model_len`, `encode_prompt(prompt)`, `apply_chat_template(messages)`,
`generate(prompt_ids, SamplingParams, index) -> AsyncIterator[SeqOutput]`, `describe()`, `shutdown()`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from tpuray.serve.llm.config import LLMConfig
from tpuray.validation import ConfigError


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def create_engine(config: LLMConfig, **options: Any):
    if config.llm_engine == "vLLM" or (config.llm_engine == "auto" and vllm_available()):
        if not vllm_available():
            raise ConfigError("llm_engine='vLLM' but vllm is not installed; valid here: 'auto', 'embedded'")
        from tpuray.serve.llm.engine.vllm_engine import VLLMEngine

        return VLLMEngine(config, **options)
    from tpuray.serve.llm.engine.embedded import EmbeddedEngine

    return EmbeddedEngine(config, **options)
