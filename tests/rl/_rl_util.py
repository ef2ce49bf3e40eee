"""Helpers of the tpuray.rl tests: a model's state dict from disk, an engine's greedy tokens."""

from __future__ import annotations

from typing import Any

import torch

from tpuray.serve.llm.engine.embedded.sampling import SamplingParams

PROMPTS = ["Hello world", "1 + 2 =", "The"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def state_dict(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def greedy(engine: Any) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
