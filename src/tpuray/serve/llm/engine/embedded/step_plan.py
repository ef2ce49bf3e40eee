"""Fixed-shape step inputs: the embedded engine's step, padded to a few bucket sizes.

XLA compiles one program per input shape, so a step whose tensors take the exact size of the batch
(every new prompt length, every batch size, every context length) compiles again and again. Here a step
becomes at most a few programs of known shapes:

* prefill: the step's prompts packed into one row of `T` tokens (T from `Buckets.tokens`), each token
  tagged with its sequence (segment), its position and its cache slot; at most `Buckets.prefill_seqs`
  prompts per pack, their last tokens' indices padded to that many;
* decode: one token per running sequence, the batch padded to `B` (from `Buckets.batch`) and attention
  over the first `L` cache positions (from `Buckets.context`).

Each pack and batch keeps its integer inputs in one tensor (`packed`), so that a step moves them to the
device in one host-to-device copy (on a TPU each copy of a few integers costs ~0.7 ms: bench_real_tpu.py).

Padding rows are harmless by construction: they write to the KV cache's trash slot and attend only to
padding. With `Buckets.exact()` (the CPU default) every size is the exact one: the same code, no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_PACK_TOKENS = 64
"""The smallest prefill pack. On the v5e (`bench_real_tpu.py prefill --dims 1b-hd128 --prompt-lens`) a
pack of 16, 32 or 64 tokens took the same step (5.9, 5.9, 5.7 ms; 128: 6.5 ms), so smaller packs would
only add programs (each ~10 s of tracing at a first start, besides its compilation)."""

MIN_PADDED_BATCH = 8
"""The smallest decode batch after 1. On the v5e (`--decode-batches`) a batch of 2 or 4 took as long as
one of 8 with 40 cached positions (7.2-7.4 ms) and longer with 600 (12.2 ms against 9.1 ms), for
context buckets of 256 and 1,024 positions (longer ones not measured: padding rows attend too)."""

FROM_DEVICE = -1
"""A decode row's token id meaning: its slot's greedy id of the latest launched step, which stays on the
device (async scheduling launches a step before the previous one is read back: runner.py)."""

Step = list[
    tuple[int, list[int], int, int | None]
]  # (slot, new token ids, start position, prompt logprobs n)


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... up to and including hi (hi itself last even if not a power of two)."""
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= 2
    return (*sizes, hi)


@dataclass(frozen=True)
class Buckets:
    """The padded sizes a step is compiled for (empty tuples: exact sizes, nothing padded)."""

    batch: tuple[int, ...] = ()
    """decode batch sizes"""
    tokens: tuple[int, ...] = ()
    """prefill pack lengths (tokens of all packed prompts together)"""
    context: tuple[int, ...] = ()
    """decode attention lengths (cache positions read per sequence)"""
    prefill_seqs: int = 0
    """prompts per prefill pack (0: as many as fit)"""

    @classmethod
    def exact(cls) -> Buckets:
        return cls()

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_model_len: int, max_prefill_tokens: int) -> Buckets:
        """Powers of two: batch 1, then MIN_PADDED_BATCH..max_num_seqs; packs MIN_PACK_TOKENS..
        max_prefill_tokens tokens; context lengths from 256 up by 4x to max_model_len; up to 8 prompts
        per pack."""
        context, n = [], min(256, max_model_len)
        while n < max_model_len:
            context.append(n)
            n *= 4
        padded = powers_of_two(min(MIN_PADDED_BATCH, max_num_seqs), max_num_seqs)
        batch = (1,) if max_num_seqs == 1 else (1, *padded)
        return cls(
            batch=batch,
            tokens=powers_of_two(min(MIN_PACK_TOKENS, max_prefill_tokens), max_prefill_tokens),
            context=(*context, max_model_len),
            prefill_seqs=min(8, max_num_seqs),
        )

    @property
    def padded(self) -> bool:
        return bool(self.batch)

    @property
    def num_programs(self) -> int:
        """Programs a compiled runner builds at warm-up: one per prefill length, one per decode shape."""
        return len(self.tokens) + len(self.batch) * len(self.context)

    @staticmethod
    def pick(n: int, sizes: tuple[int, ...]) -> int:
        """The smallest size >= n (n itself when `sizes` is empty)."""
        for size in sizes:
            if size >= n:
                return size
        if sizes:
            raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
        return n


@dataclass
class PrefillPack:
    """A pack's inputs in one [5, T] tensor: rows tokens, positions, segments (index into `rows`; padding:
    -1), slots (each token's cache slot; padding: the trash slot) and, in its first P entries, each
    prompt's last token in the pack (padding: 0)."""

    rows: list[int]  # the step's batch indices, in pack order
    packed: torch.Tensor  # [5, T]
    num_prompts: int  # P

    @staticmethod
    def unpack(
        packed: torch.Tensor, num_prompts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, positions, segments, slots [T] and last_index [P] (views of `packed`)."""
        return packed[0], packed[1], packed[2], packed[3], packed[4, :num_prompts]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This pack's tokens, positions, segments, slots and last_index (views of `packed`)."""
        return self.unpack(self.packed, self.num_prompts)


@dataclass
class DecodeBatch:
    """A batch's inputs in one [3, B] tensor: rows tokens, positions and slots (padding: the trash slot)."""

    rows: list[int]
    packed: torch.Tensor  # [3, B]
    context_len: int  # L: cache positions read


def pack_prefills(batch: Step, rows: list[int], buckets: Buckets, trash_slot: int) -> list[PrefillPack]:
    """Packs of the prompts at `rows` (in order), each within the largest token bucket and
    `prefill_seqs` prompts."""
    max_tokens = buckets.tokens[-1] if buckets.tokens else None
    packs: list[list[int]] = []
    used = 0
    for i in rows:
        n = len(batch[i][1])
        full = packs and (
            (max_tokens is not None and used + n > max_tokens)
            or (buckets.prefill_seqs and len(packs[-1]) >= buckets.prefill_seqs)
        )
        if not packs or full:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += n
    return [_pack(batch, pack, buckets, trash_slot) for pack in packs]


def _pack(batch: Step, rows: list[int], buckets: Buckets, trash_slot: int) -> PrefillPack:
    total = sum(len(batch[i][1]) for i in rows)
    T = Buckets.pick(total, buckets.tokens)
    P = buckets.prefill_seqs if buckets.padded else len(rows)
    packed = torch.zeros(5, T, dtype=torch.long)
    tokens, positions, segments, slots, last = PrefillPack.unpack(packed, P)
    segments.fill_(-1)
    slots.fill_(trash_slot)
    at = 0
    for seg, i in enumerate(rows):
        slot, ids, start, _ = batch[i]
        n = len(ids)
        tokens[at : at + n] = torch.tensor(ids, dtype=torch.long)
        positions[at : at + n] = torch.arange(start, start + n)
        segments[at : at + n] = seg
        slots[at : at + n] = slot
        last[seg] = at + n - 1
        at += n
    return PrefillPack(rows, packed, P)


def decode_batches(batch: Step, rows: list[int], buckets: Buckets, trash_slot: int) -> list[DecodeBatch]:
    """The one-token sequences at `rows` in batches of at most the largest batch bucket."""
    limit = buckets.batch[-1] if buckets.batch else max(len(rows), 1)
    out = []
    for lo in range(0, len(rows), limit):
        chunk = rows[lo : lo + limit]
        B = Buckets.pick(len(chunk), buckets.batch)
        packed = torch.zeros(3, B, dtype=torch.long)
        tokens, positions, slots = packed
        slots.fill_(trash_slot)
        for j, i in enumerate(chunk):
            slot, ids, start, _ = batch[i]
            tokens[j], positions[j], slots[j] = ids[0], start, slot
        context = Buckets.pick(int(positions.max()) + 1, buckets.context)
        out.append(DecodeBatch(chunk, packed, context))
    return out
