"""Weights of an update: Hugging Face names and shapes and the engines' tensor-parallel layouts
(`layout`: the embedded engine's; `vllm_layout`: vLLM's), cutting an update where it lives (`cut`),
joining a rollout rank's part from the pieces it received (`join`, staged as row blocks: `rows`), the
one check of names and shapes (`check`), the host buffers reused between updates (`buffers`) and an
update's tensors sent to the device ahead of the loader (`prefetch`)."""
