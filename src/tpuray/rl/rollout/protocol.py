"""`GenerationEngine`: what a `RolloutEngine` drives to generate, as a typed Protocol.

tpuray's embedded engine (`EmbeddedEngine`) satisfies it as it is; `tpuray.rl.rollout.vllm.VLLMGeneration`
is the same interface over vLLM's engine. Weight updates and sleep / wake-up are the rollout engine's own
(`EmbeddedRolloutEngine` through its workers, `VLLMRolloutEngine` through a vLLM worker extension), each
sleep level checked by `check_sleep_level`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from tpuray.rl.config import SLEEP_LEVELS
from tpuray.serve.llm.generation import SamplingParams


def check_sleep_level(level: Any) -> None:
    """ValueError naming a sleep level that is not one of SLEEP_LEVELS."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep(level={level!r}) is invalid; valid: 1 (weights kept in host memory), 2 (weights "
            "discarded: update_weights with the full state before the next generate)"
        )


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
