"""vLLM adapter (used only when `import vllm` works, e.g. vllm-tpu on a real slice).

vLLM's own Ray executor places its workers; tpuray hands it the model directory and engine_kwargs
unchanged. Not exercised by tests on machines without vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tpuray.serve.llm.config import LLMConfig
from tpuray.serve.llm.engine.prompts import PromptEncoder
from tpuray.serve.llm.engine.sampling import SamplingParams
from tpuray.serve.llm.engine.scheduler import SeqOutput


class VLLMEngine(PromptEncoder):
    def __init__(self, config: LLMConfig, **_: Any):
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        config.check_model_source()
        self.config = config
        path = config.model_loading_config.local_path
        kwargs = {k: v for k, v in config.engine_kwargs.items() if k != "task"}
        kwargs["tensor_parallel_size"] = config.tensor_parallel_size
        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=path, **kwargs))
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_loading_config.tokenizer_source or path)
        self.max_model_len = kwargs.get("max_model_len") or self.tokenizer.model_max_length
        self._next = 0

    def describe(self) -> dict[str, Any]:
        return {"engine": "vLLM", "model": self.config.model_id, "max_model_len": self.max_model_len}

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, index: int = 0
    ) -> AsyncIterator[SeqOutput]:
        from vllm import SamplingParams as VSamplingParams

        seed = None if params.seed is None else params.seed * 1_000_003 + index
        vparams = VSamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop=params.stop or None,
            seed=seed,
        )
        self._next += 1
        sent_text, sent_tokens = 0, 0
        async for out in self.engine.generate(
            {"prompt_token_ids": prompt_ids}, vparams, f"tpuray-{self._next}"
        ):
            c = out.outputs[0]
            yield SeqOutput(
                c.text[sent_text:],
                list(c.token_ids[sent_tokens:]),
                out.finished,
                c.finish_reason if out.finished else None,
                len(prompt_ids),
                len(c.token_ids),
            )
            sent_text, sent_tokens = len(c.text), len(c.token_ids)

    def shutdown(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown:
            shutdown()
