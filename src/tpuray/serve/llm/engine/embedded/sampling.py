"""Batched token sampling (temperature, top-k, top-p, min-p, per-row seeds).

One call samples the whole batch: each row has its own parameters and its own seeded generator, so a
seeded sequence samples the same tokens whatever else is in the batch. Logits processing before sampling
(penalties, logit_bias, token masks, grammar masks) is in logits.py; the order follows vLLM's: penalties
and bias -> min_tokens / allowed_token_ids masks -> grammar mask -> greedy or temperature -> min-p ->
top-k / top-p -> inverse-CDF draw.
"""

from __future__ import annotations

import torch

from tpuray.serve.llm.generation import SamplingParams


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
