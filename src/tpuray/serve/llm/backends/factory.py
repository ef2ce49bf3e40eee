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
    """The backend the config's engine asks for (engine resolved in LLMConfig: "vLLM" or "embedded"). Under
    llm_engine "auto" the replica's host has the last word: on a real TPU with vLLM-TorchTPU the embedded
    engine serves (engine/vllm/support.py `auto_prefers_embedded`), and a model vLLM finds it cannot serve
    as configured when it starts (`VLLMCannotServe`) goes to the embedded engine too."""
    if config.task == "embed":
        from tpuray.serve.llm.backends.embedding import EmbeddingBackend

        return EmbeddingBackend(config)
    if config.engine == "vLLM":
        backend = _vllm_backend(config)
        if backend is not None:
            return backend
    from tpuray.serve.llm.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(config)


def _vllm_backend(config: LLMConfig) -> Backend | None:
    """vLLM's backend for the config; None where llm_engine "auto" hands the model to the embedded engine
    (config.engine is then "embedded")."""
    from tpuray.serve.llm import model_source
    from tpuray.serve.llm.engine.vllm.support import VLLMCannotServe

    # build_openai_app decided this already; a config started directly is decided here
    config.choose_engine_for_model(model_source.read_config(config.model_source))
    config.prefer_embedded_on_this_host()
    if config.engine != "vLLM":
        return None
    from tpuray.serve.llm.backends.vllm import VLLMBackend

    try:
        return VLLMBackend(config)
    except VLLMCannotServe as e:  # found as vLLM starts, before it loads or compiles anything
        if config.llm_engine != "auto":
            raise
        config.serve_with_embedded(str(e))
        return None
