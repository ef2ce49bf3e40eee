"""The embedded PyTorch engine (`engine.EmbeddedEngine`) and its internals: one Ray actor per chip
(`worker.EngineWorker`) runs the Llama-style model (`model`) with its KV cache (`kv_cache`) through
shape-static steps (`runner`, `step_plan`; on a TPU compiled once and kept on the host's disk: `programs`,
`tpu_compile`); the scheduler
(`scheduler`) batches sequences and samples (`sampling`, `logits`, `grammar`); what it takes and gives
(`SamplingParams`, `SeqOutput`, `PromptEncoder`) is engine-neutral: `tpuray.serve.llm.generation`; what
it honours and refuses: `tpuray.serve.llm.openai.checks` (request fields), `config` (engine_kwargs).

The engine's interface, used by the embedded backend (`tpuray.serve.llm.backends.embedded.EmbeddedBackend`):
`tokenizer`, `max_model_len`, `encode_prompt(prompt)`, `apply_chat_template(messages)`,
`generate(prompt_ids, SamplingParams, index) -> AsyncIterator[SeqOutput]`, `describe()`, `shutdown()`.
"""
