"""Engines behind an LLM deployment, one subpackage each; `LLMConfig.engine` says which one a model gets:

- `vllm/`: vLLM (`vllm/engine.py`, with vLLM's own OpenAI layer) where it is installed, plus tpuray's glue
  around it (engine_kwargs -> vLLM's arguments, the emulated-TPU platform plugin, what vLLM can run);
- `embedded/`: the embedded PyTorch engine (`embedded/engine.py`) and its internals (model, KV cache,
  runner, scheduler, sampling, ...).

Importing this package (or either subpackage) imports neither vLLM nor torch.
"""
