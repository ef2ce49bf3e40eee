"""Continuous batching: sequences join the running batch at any step and leave as soon as they finish.

Each step the scheduler admits waiting sequences into free KV-cache slots (their whole prompt is the
step's prefill, bounded by `max_prefill_tokens`), adds one decode token for every running sequence, and
after the forward processes the batch's logits (penalties, logit_bias, grammar masks: logits.py), samples
one token per sequence (sampling.py), records logprobs, detokenizes incrementally, applies stop strings /
stop tokens / EOS / a completed grammar / length limits and frees finished slots.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from tpuray.serve.llm.engine.embedded import grammar as grammar_lib
from tpuray.serve.llm.engine.embedded.logits import (
    apply_bitmask,
    apply_logit_bias,
    apply_penalties,
    apply_token_masks,
    token_logprobs,
)
from tpuray.serve.llm.engine.embedded.sampling import sample_batch
from tpuray.serve.llm.engine.embedded.step_plan import FROM_DEVICE
from tpuray.serve.llm.generation import SamplingParams, SeqOutput, TokenLogprobs


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    queue: asyncio.Queue
    seq_id: int = 0
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # chars of `text` already sent
    stop_from: int = 0  # chars of `text` made by the first min_tokens tokens: no stop string ends there
    prefix_offset: int = 0  # detokenizer window: output_ids[prefix_offset:read_offset] were decoded last
    read_offset: int = 0
    sent_tokens: int = 0
    finished: bool = False
    matcher: Any = None  # the grammar matcher when params.grammar constrains the output
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token (params.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None
    sent_prompt_logprobs: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        tokenizer,
        eos_ids: set[int],
        max_num_seqs: int,
        max_model_len: int,
        max_prefill_tokens: int = 4096,
        grammars: Any = None,
    ):
        self.tokenizer = tokenizer
        self.grammars = grammars  # grammar.Grammars (made by the engine when a request first needs one)
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max(max_prefill_tokens, max_model_len)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()

    def add(self, seq: Sequence) -> None:
        if seq.params.grammar is not None and seq.matcher is None:
            seq.matcher = self.grammars.matcher(seq.params.grammar)
        seq.seq_id = next(self._ids)
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        seq.finished = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(
        self, ahead: list[Sequence] | None = None
    ) -> tuple[list[Sequence], list[tuple[int, list[int], int, int | None]]]:
        """The sequences of the next step and the worker batch (slot, new tokens, start position).

        `ahead` (async scheduling): the sequences of a launched step whose tokens are not read back yet.
        Each gets a decode row whose token is `FROM_DEVICE` (the step's greedy id, still on the device)
        at the position after that step's; one that step certainly finishes (by length) is left out,
        and one it finishes otherwise (a stop token or string) computes a token `process` discards."""
        budget = self.max_prefill_tokens
        while self.waiting and self.free_slots and len(self.waiting[0].prompt_ids) <= budget:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            budget -= len(seq.prompt_ids)
            self.running.append(seq)
        in_flight = {s.seq_id for s in ahead or ()}
        seqs: list[Sequence] = []
        batch: list[tuple[int, list[int], int, int | None]] = []
        for seq in self.running:
            if seq.seq_id in in_flight:
                if self._ends_by_length(seq, len(seq.output_ids) + 1):
                    continue
                batch.append((seq.slot, [FROM_DEVICE], seq.num_tokens, None))
            elif seq.output_ids:
                batch.append((seq.slot, seq.output_ids[-1:], seq.num_tokens - 1, None))
            else:
                batch.append((seq.slot, seq.prompt_ids, 0, seq.params.prompt_logprobs))
            seqs.append(seq)
        return seqs, batch

    def _ends_by_length(self, seq: Sequence, outputs: int) -> bool:
        """Whether a sequence with `outputs` output tokens is done by max_tokens or max_model_len."""
        return outputs >= seq.params.max_tokens or len(seq.prompt_ids) + outputs >= self.max_model_len

    def _processed(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The logits each row samples from: penalties, logit_bias, min_tokens / allowed_token_ids and
        grammar masks applied."""
        params = [s.params for s in seqs]
        penal = [i for i, p in enumerate(params) if p.penalized]
        biased = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias}
        banned = {
            i: self._stop_tokens(p)
            for i, (s, p) in enumerate(zip(seqs, params, strict=True))
            if len(s.output_ids) < p.min_tokens
        }
        allowed = {i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids}
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None and not s.finished]
        if not (penal or biased or banned or allowed or constrained):
            return logits
        out = logits.clone()
        apply_penalties(
            out,
            penal,
            [seqs[i].prompt_ids for i in penal],
            [seqs[i].output_ids for i in penal],
            [params[i].presence_penalty for i in penal],
            [params[i].frequency_penalty for i in penal],
            [params[i].repetition_penalty for i in penal],
        )
        apply_logit_bias(out, biased)
        apply_token_masks(out, banned, allowed)
        if constrained:
            mask = self.grammars.bitmask([seqs[i].matcher for i in constrained])
            apply_bitmask(out, mask, constrained)
        return out

    def _stop_tokens(self, params: SamplingParams) -> list[int]:
        """The tokens that end a sequence: stop_token_ids, and EOS unless ignore_eos."""
        eos = [] if params.ignore_eos else sorted(self.eos_ids)
        return [*eos, *params.stop_token_ids]

    def needs_logits(self, seqs: list[Sequence]) -> bool:
        """Whether any sequence of the step samples from more than the argmax (temperature, penalties,
        bias, masks, grammar, logprobs): only then does the step read the logits back from the chips."""
        for s in seqs:
            p = s.params
            if (
                p.temperature > 0.0
                or p.logprobs is not None
                or p.penalized
                or p.logit_bias
                or p.allowed_token_ids
                or len(s.output_ids) < p.min_tokens
                or s.matcher is not None
            ):
                return True
        return False

    def process(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor | None,
        prompt_lps: dict | None = None,
        greedy: list[int] | None = None,
    ) -> None:
        """Sample one token per sequence (or take `greedy`, the device's argmax, where no logits were
        read back), record logprobs, emit outputs, retire finished sequences."""
        if logits is None:
            assert greedy is not None, "a step without logits must carry the greedy tokens"
            tokens = list(greedy)
        else:
            tokens = sample_batch(
                self._processed(seqs, logits), [s.params for s in seqs], [s.generator for s in seqs]
            )
        records = self._token_logprobs(seqs, logits, tokens)
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if seq.finished:  # aborted while the step ran
                continue
            if prompt_lps and i in prompt_lps:
                seq.prompt_logprobs = prompt_lps[i]
            if seq.params.max_tokens == 0:  # the prompt alone (echo): its prefill ran, nothing is generated
                self._emit(seq, "length")
                continue
            self._emit(seq, self._take(seq, token, records.get(i)))

    @staticmethod
    def _token_logprobs(
        seqs: list[Sequence], logits: torch.Tensor | None, tokens: list[int]
    ) -> dict[int, TokenLogprobs]:
        """{row: the logprobs record of its sampled token} for the rows that asked for logprobs."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not want or logits is None:
            return {}
        lp = torch.log_softmax(logits[want].float(), dim=-1)  # the raw model distribution (vLLM's default)
        got = token_logprobs(lp, [tokens[i] for i in want], [seqs[i].params.logprobs or 0 for i in want])
        return dict(zip(want, got, strict=True))

    def _take(self, seq: Sequence, token: int, record: TokenLogprobs | None) -> str | None:
        """Add the sampled `token` (and its logprobs `record`) to `seq`; why it finishes, or None."""
        if token in seq.params.stop_token_ids or (token in self.eos_ids and not seq.params.ignore_eos):
            if seq.params.include_stop_str_in_output:  # vLLM: the stop token is part of the output
                seq.output_ids.append(token)
                if record is not None:
                    seq.logprobs.append(record)
            return "stop"
        seq.output_ids.append(token)
        if record is not None:
            seq.logprobs.append(record)
        if seq.matcher is not None:
            if not grammar_lib.accept(seq.matcher, token):
                logger.warning("grammar refused a token it allowed; ending the sequence")
                return "stop"
            if grammar_lib.finished(seq.matcher):  # complete: only a stop token could follow
                return "stop"
        return "length" if self._ends_by_length(seq, len(seq.output_ids)) else None

    def _detokenize(self, seq: Sequence, final: bool) -> str:
        """The output's text so far, decoding only the newest tokens plus the previous step's ones (that
        context keeps tokenizers which merge spaces or bytes across tokens exact). An incomplete UTF-8
        character is held back until a later token completes it or the sequence ends."""
        ids, skip = seq.output_ids, seq.params.skip_special_tokens
        before = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            seq.text += after[len(before) :]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return seq.text

    def _emit(self, seq: Sequence, reason: str | None) -> None:
        text = self._detokenize(seq, final=reason is not None)
        params = seq.params
        stops = params.stop
        if len(seq.output_ids) <= params.min_tokens:
            seq.stop_from = len(text)
        elif stops:
            end = _first_stop(text, stops, max(seq.emitted, seq.stop_from))
            if end is not None:
                text, reason = text[: end[1] if params.include_stop_str_in_output else end[0]], "stop"
        if reason is None:
            # hold back an incomplete UTF-8 character and anything that could still become a stop string
            # (unless the stop string goes out with the text anyway)
            safe = len(text.rstrip("\ufffd"))
            if stops and not params.include_stop_str_in_output:
                safe = min(safe, len(text) - max(len(s) for s in stops) + 1)
            delta = text[seq.emitted : max(safe, seq.emitted)]
        else:
            delta = text[seq.emitted :]
        seq.text = text
        seq.emitted += len(delta)
        if reason is not None:
            seq.finished = True
            self._release(seq)
        if delta or reason is not None:  # tokens held back with their text go out with the next delta
            new_tokens = seq.output_ids[seq.sent_tokens :]
            new_logprobs = seq.logprobs[seq.sent_tokens :] if seq.params.logprobs is not None else []
            prompt_logprobs = None
            if seq.params.prompt_logprobs is not None and not seq.sent_prompt_logprobs:
                prompt_logprobs, seq.sent_prompt_logprobs = seq.prompt_logprobs or [], True
            seq.sent_tokens = len(seq.output_ids)
            seq.queue.put_nowait(
                SeqOutput(
                    delta,
                    new_tokens,
                    seq.finished,
                    reason,
                    len(seq.prompt_ids),
                    len(seq.output_ids),
                    new_logprobs,
                    prompt_logprobs,
                )
            )

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1


def _first_stop(text: str, stops: list[str], checked: int) -> tuple[int, int] | None:
    """(start, end) of the stop string that completes first in `text` after its first `checked` chars
    (vLLM's rule: earliest end, ties by list order), or None."""
    best: tuple[int, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, checked - len(stop) + 1))
        if start >= 0 and (best is None or start + len(stop) < best[1]):
            best = (start, start + len(stop))
    return best
