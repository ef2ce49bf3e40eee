"""`GenerationEngine`: what a `RolloutEngine` drives to generate, as a typed Protocol.

tpuray's embedded engine (`EmbeddedEngine`) satisfies it as it is; `tpuray.rl.vllm_rollout.VLLMGeneration`
is the same interface over vLLM's engine. Weight updates and sleep / wake-up are the rollout engine's own
(`RolloutEngine` for the embedded engine, `VLLMRolloutEngine` through a vLLM worker extension)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, get_args

from tpuray.serve.llm.generation import SamplingParams

SleepLevel = Literal[1, 2]
"""How a rollout engine sleeps (vLLM's levels): 1, its weights copied to host memory first; 2, discarded
(the next update must replace them all before it generates again). Either way the KV cache is dropped."""
SLEEP_LEVELS: tuple[int, ...] = get_args(SleepLevel)


class SeqChunk(Protocol):
    """What one sequence produced since its last chunk (`SeqOutput` of the embedded engine)."""

    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[Any]: ...  # (token id, logprob, top) of each token_ids entry
    @property
    def finish_reason(self) -> str | None: ...


class GenerationEngine(Protocol):
    """Batched generation from token ids, one async stream per sequence."""

    @property
    def tokenizer(self) -> Any: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def runner(self) -> Any: ...  # the in-process ModelRunner of the embedded engine; None elsewhere
    @property
    def group(self) -> Any: ...  # the slice's SliceWorkerGroup of the embedded engine; None elsewhere

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]: ...
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, index: int = 0
    ) -> AsyncIterator[SeqChunk]: ...
    def describe(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...
