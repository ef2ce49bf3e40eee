"""The `vllm.platform_plugins` entry point's former path, for installs whose metadata predates the move of
the vLLM glue into `engine/vllm/` (pyproject.toml now names `tpuray.serve.llm.engine.vllm.plugin:register`;
an editable install keeps the old path until it is reinstalled). Nothing in tpuray imports this module.
"""

from tpuray.serve.llm.engine.vllm.plugin import register

__all__ = ["register"]
