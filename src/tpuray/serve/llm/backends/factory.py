"""The backend factory: which backend serves a model, from its config (`LLMConfig.task` and `.engine`).

- task "embed": `EmbeddingBackend` (embedding.py);
- engine "vLLM": `VLLMBackend` (vllm.py), vLLM's engine and vLLM's own OpenAI layer;
- engine "embedded": `EmbeddedBackend` (embedded.py), the embedded engine with tpuray's OpenAI layer.

Each backend module is imported only when its backend is made (vLLM's and torch's imports are heavy).
"""

from __future__ import annotations

from tpuray.serve.llm.backends.base import Backend
from tpuray.serve.llm.config import LLMConfig


def create_backend(config: LLMConfig) -> Backend:
    """The backend the config's engine asks for (engine resolved in LLMConfig: "vLLM" or "embedded")."""
    if config.task == "embed":
        from tpuray.serve.llm.backends.embedding import EmbeddingBackend

        return EmbeddingBackend(config)
    if config.engine == "vLLM":
        from tpuray.serve.llm import model_source

        # build_openai_app decided this already; a config started directly is decided here
        config.choose_engine_for_model(model_source.read_config(config.model_source))
    if config.engine == "vLLM":
        from tpuray.serve.llm.backends.vllm import VLLMBackend

        return VLLMBackend(config)
    from tpuray.serve.llm.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(config)
