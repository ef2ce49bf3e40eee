"""`tpuray.serve.llm`: the `ray.serve.llm` API on TPU slices (real or emulated).

    from tpuray.serve.llm import LLMConfig, LLMServingArgs, ModelLoadingConfig, build_openai_app

Importing this package is cheap; Ray Serve / FastAPI load when an app is built.
"""

from __future__ import annotations

import importlib
from typing import Any

from tpuray.serve.llm.config import LLMConfig, LLMServingArgs, ModelLoadingConfig

_LAZY = {
    "build_openai_app": "tpuray.serve.llm.app",
    "build_llm_deployment": "tpuray.serve.llm.app",
    "LLMServer": "tpuray.serve.llm.deployments.server",
    "LLMRouter": "tpuray.serve.llm.deployments.router",
    "minilm_config": "tpuray.serve.llm.backends.embedding",
}

__all__ = ["LLMConfig", "LLMServingArgs", "ModelLoadingConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tpuray.serve.llm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
