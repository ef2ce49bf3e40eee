"""Sampling parameters and batched token sampling (temperature, top-k, top-p, min-p, per-row seeds).

One call samples the whole batch: each row has its own parameters and its own seeded generator, so a
seeded sequence samples the same tokens whatever else is in the batch. Logits processing before sampling
(penalties, logit_bias, token masks, grammar masks) is in logits.py; the order follows vLLM's: penalties
and bias -> min_tokens / allowed_token_ids masks -> grammar mask -> greedy or temperature -> min-p ->
top-k / top-p -> inverse-CDF draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingParams:
    """What one sequence samples with. Requests are validated in openai_schema.py; this only guards ranges."""

    max_tokens: int = 16  # 0: prefill only (completions' echo with max_tokens 0)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # EOS is an ordinary token: generate until max_tokens or a stop
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings unchecked) until this many
    include_stop_str_in_output: bool = False  # the stop string / stop token ends the output text
    skip_special_tokens: bool = True  # decode without the tokenizer's special tokens
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # the same for every prompt token (echo)
    grammar: Any = None  # a llguidance grammar (grammar.py) the output must follow

    def __post_init__(self) -> None:
        if self.max_tokens < 0:  # 0: the prompt alone (its logprobs), nothing generated
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def generator(self, index: int = 0) -> torch.Generator:
        """A generator per sequence: choice `index` of a seeded request is reproducible on its own."""
        seed = random.getrandbits(63) if self.seed is None else (self.seed * 1_000_003 + index) % (2**63)
        return torch.Generator().manual_seed(seed)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p x the most likely one (as transformers' MinPLogitsWarper)."""
    top = probs.max(dim=-1, keepdim=True).values
    return probs * (probs >= min_p * top)


def _top_k(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k most likely tokens of each row (k = vocab where off); ties at the k-th value stay."""
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = torch.sort(probs, dim=-1, descending=True).values.gather(1, k - 1)
    return probs * (probs >= kth)


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of [batch, vocab] (processed) logits. Temperature 0 is greedy (argmax)."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not rows:
        return greedy
    temps = torch.tensor([[params[i].temperature] for i in rows])
    probs = torch.softmax(logits[rows].float() / temps, dim=-1)
    if any(params[i].min_p > 0 for i in rows):
        probs = _min_p(probs, torch.tensor([[params[i].min_p] for i in rows]))
    if any(params[i].top_k > 0 for i in rows):
        probs = _top_k(probs, torch.tensor([[max(params[i].top_k, 0)] for i in rows]))
    order = None
    top_p = torch.tensor([[params[i].top_p] for i in rows])
    if bool((top_p < 1.0).any()):
        probs, order = torch.sort(probs, dim=-1, descending=True)
        mass = probs.sum(dim=-1, keepdim=True)
        probs = probs * (torch.cumsum(probs, dim=-1) - probs < top_p * mass)  # keeps the most likely token
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
    if order is not None:
        picked = torch.gather(order, 1, picked)
    for i, token in zip(rows, picked.squeeze(1).tolist(), strict=True):
        greedy[i] = token
    return greedy
