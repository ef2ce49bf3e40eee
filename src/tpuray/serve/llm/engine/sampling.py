"""Sampling parameters and token sampling (temperature, top-p, per-sequence seeded generators)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self, index: int = 0) -> torch.Generator:
        """A generator per sequence: choice `index` of a seeded request is reproducible on its own."""
        seed = random.getrandbits(63) if self.seed is None else (self.seed * 1_000_003 + index) % (2**63)
        return torch.Generator().manual_seed(seed)


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of [batch, vocab] logits, each row with its own params and generator.

    Softmax, top-p masking and inverse-CDF sampling run once for the whole batch; each row draws its
    uniform number from its own generator, so a seeded sequence samples the same tokens whatever else is
    in the batch. Temperature 0 is greedy (argmax).
    """
    greedy = torch.argmax(logits, dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not rows:
        return greedy
    temps = torch.tensor([[params[i].temperature] for i in rows])
    probs = torch.softmax(logits[rows].float() / temps, dim=-1)
    order = None
    top_p = torch.tensor([[params[i].top_p] for i in rows])
    if bool((top_p < 1.0).any()):
        probs, order = torch.sort(probs, dim=-1, descending=True)
        probs = probs * (torch.cumsum(probs, dim=-1) - probs < top_p)  # always keeps the most likely token
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
    if order is not None:
        picked = torch.gather(order, 1, picked)
    for i, token in zip(rows, picked.squeeze(1).tolist(), strict=True):
        greedy[i] = token
    return greedy
