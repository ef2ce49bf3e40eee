"""Logits processing for a batch, before sampling: penalties, logit_bias, grammar masks; and logprobs.

Every function works on the whole [batch, vocab] tensor at once, touching only the rows that asked for
something. Semantics (the tests compare them with transformers' logits processors on the same input):
- repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor, vLLM): for every token already in
  the prompt or the output, a positive logit is divided by the penalty and a negative one multiplied;
- presence / frequency penalty (OpenAI, vLLM): logit -= frequency x (count in the output) + presence x
  (1 if it occurs in the output);
- logit_bias (OpenAI; transformers' SequenceBiasLogitsProcessor with one-token sequences): added;
- min_tokens (vLLM): EOS (unless ignore_eos) and stop_token_ids get -inf until min_tokens were generated;
- allowed_token_ids (vLLM): every other token gets -inf;
- grammar masks (llguidance's bitmask, one int32 bit per token): disallowed tokens get -inf.
Logprobs are those of the raw model distribution (log_softmax of the unprocessed logits), as vLLM
returns them by default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tpuray.serve.llm.generation import TokenLogprobs

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> None:
    """In place, on `rows` of logits; prompts/outputs/penalties are given per listed row."""
    if not rows:
        return
    vocab = logits.shape[-1]
    sub = logits[list(rows)]
    counts = torch.zeros(len(rows), vocab)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for j, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if output:
            counts[j].index_add_(0, torch.tensor(output), torch.ones(len(output)))
        if prompt:
            seen[j, torch.tensor(prompt)] = True
    seen |= counts > 0
    rep = torch.tensor(repetition, dtype=sub.dtype)[:, None]
    penalty = torch.where(seen, rep, torch.ones_like(rep))
    sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    sub = sub - torch.tensor(frequency, dtype=sub.dtype)[:, None] * counts
    sub = sub - torch.tensor(presence, dtype=sub.dtype)[:, None] * (counts > 0)
    logits[list(rows)] = sub


def apply_logit_bias(logits: torch.Tensor, biases: dict[int, dict[int, float]]) -> None:
    """In place: row -> {token id: bias}."""
    for row, bias in biases.items():
        if bias:
            ids = torch.tensor(list(bias))
            logits[row, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)


def apply_token_masks(
    logits: torch.Tensor, banned: Mapping[int, Sequence[int]], allowed: Mapping[int, Sequence[int]]
) -> None:
    """In place: row -> token ids that may not be sampled (min_tokens: EOS and stop_token_ids), row -> the
    only token ids that may be (allowed_token_ids); the others get -inf."""
    for row, ids in banned.items():
        if ids:
            logits[row, list(ids)] = float("-inf")
    for row, ids in allowed.items():
        keep = torch.full_like(logits[row], float("-inf"))
        index = torch.tensor(list(ids))
        keep[index] = logits[row, index]
        logits[row] = keep


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: tokens not allowed by row r of the int32 bitmask ([len(rows), ceil(V/32)]) -> -inf."""
    if not rows:
        return
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    if allowed.shape[1] < vocab:
        pad = torch.zeros(len(rows), vocab - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad], dim=1)
    idx = list(rows)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def token_logprobs(
    logprobs: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row of [rows, vocab] log-probabilities: the chosen token's and the top-n alternatives."""
    k = max(top_n, default=0)
    chosen = logprobs.gather(1, torch.tensor(list(tokens)).unsqueeze(1)).squeeze(1).tolist()
    if k:
        top_vals, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    out: list[TokenLogprobs] = []
    for j, (token, n) in enumerate(zip(tokens, top_n, strict=True)):
        top = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else []
        out.append((int(token), float(chosen[j]), top))
    return out
