"""The embedded serving engine on a real TPU chip: compiled programs built at warm-up only, and the same
greedy tokens as on the CPU for a small model trained here (random weights have near-ties that flip)."""

from __future__ import annotations

import random

import pytest

from tpuray.serve.llm.engine.embedded.runner import ModelRunner
from tpuray.serve.llm.engine.embedded.step_plan import FROM_DEVICE


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    from tpuray.models import train_tiny_causal_lm

    return str(train_tiny_causal_lm(tmp_path_factory.mktemp("trained") / "model", steps=150))


def _greedy(runner: ModelRunner, prompt: list[int], n: int, ahead: bool = False, slot: int = 0) -> list[int]:
    """`n` greedy tokens of cache slot `slot`; `ahead` (async scheduling): each step launched before the
    previous one is read back, its token taken from that step's ids on the device."""
    pending, out = runner.launch([(slot, prompt, 0, None)], need_logits=False), []
    for i in range(n - 1):
        if ahead:
            launched = runner.launch([(slot, [FROM_DEVICE], len(prompt) + i, None)], need_logits=False)
        res = runner.collect(pending)
        assert res is not None
        out.append(res.token_ids[0])
        if not ahead:
            launched = runner.launch([(slot, [out[-1]], len(prompt) + i, None)], need_logits=False)
        pending = launched
    res = runner.collect(pending)
    assert res is not None
    return [*out, res.token_ids[0]]


def test_greedy_tokens_equal_cpu_and_no_compilation_after_warmup(tpu, trained_model, highest_precision):
    kw = dict(max_num_seqs=4, max_model_len=256, dtype="float32")
    cpu = ModelRunner(trained_model, **kw)
    chip = ModelRunner(trained_model, device="tpu", **kw)
    assert chip.compiled and not cpu.compiled
    assert chip.backend == "tpu-donate"  # the KV cache updated in place (tpu_compile.py)
    built = chip.warmup()
    assert built == chip.buckets.num_programs
    prompt = list(range(5, 17))
    want = _greedy(cpu, prompt, 64)
    assert _greedy(chip, prompt, 64) == want
    assert _greedy(chip, prompt, 64, ahead=True, slot=1) == want  # async scheduling, in a fresh slot
    # two prompts packed in one prefill (fresh slots): each attends to its own tokens only, which a
    # program made causal by torch_tpu's detect_causal_mask pass would not do (runner.warmup_prefill)
    two = [(2, prompt, 0, None), (3, list(range(20, 31)), 0, None)]
    on_chip, on_cpu = chip.step(two, need_logits=False), cpu.step(two, need_logits=False)
    assert on_chip is not None and on_cpu is not None and on_chip.token_ids == on_cpu.token_ids
    rng = random.Random(0)  # mixed prompt lengths and batch sizes: every shape is a warmed-up bucket
    for _ in range(20):
        step = [(s, [rng.randrange(3, 100) for _ in range(rng.randrange(1, 60))], 0, None) for s in range(4)]
        res = chip.step(step, need_logits=rng.random() < 0.5)
        assert res is not None and len(res.token_ids) == 4
    assert chip.compilations == built


def test_a_reused_cache_slot_gives_the_same_tokens(tpu, trained_model, highest_precision):
    """A slot's stale keys beyond its sequence are masked: on torch_tpu 0.2.0 a decode mask [B, 1, 1, L]
    (broadcast over the query rows) was ignored, so a reused slot's tokens diverged (found 2026-12-04;
    the cache probe, benchmarks/notes/real-tpu.md); the model now expands the mask to the scores' shape."""
    chip = ModelRunner(trained_model, device="tpu", max_num_seqs=4, max_model_len=256, dtype="float32")
    prompt = list(range(5, 17))
    first = _greedy(chip, prompt, 32)
    assert _greedy(chip, prompt, 32) == first  # the same slot again
    for t in (*chip.cache.k, *chip.cache.v):  # garbage beyond the sequence: must be masked out
        t[2, len(prompt) :] = 50.0
    assert _greedy(chip, prompt, 32, slot=2) == first


def test_dense_cache_writes_give_the_cpu_tokens(tpu, trained_model, highest_precision):
    """The decode step a real TPU runs for batches of 2+ rows (K/V written densely, attention as
    matmuls: kv_cache.dense_writer), forced here at every batch size: the CPU's greedy tokens, alone and
    with four sequences decoding together."""
    kw = dict(max_num_seqs=4, max_model_len=256, dtype="float32")
    cpu = ModelRunner(trained_model, **kw)
    chip = ModelRunner(trained_model, device="tpu", kv_write="dense", **kw)
    assert chip.kv_write == "dense" and chip.model.decode_attention == "matmul"
    prompt = list(range(5, 17))
    assert _greedy(chip, prompt, 64) == _greedy(cpu, prompt, 64)
    rows = [(s, list(range(5 + s, 17 + 2 * s)), 0, None) for s in range(4)]
    for _ in range(8):
        on_chip, on_cpu = chip.step(rows, need_logits=False), cpu.step(rows, need_logits=False)
        assert on_chip is not None and on_cpu is not None and on_chip.token_ids == on_cpu.token_ids
        rows = [
            (s, [t], start + len(ids), None)
            for (s, ids, start, _), t in zip(rows, on_cpu.token_ids, strict=True)
        ]


@pytest.mark.parametrize("backend", ["tpu", "tpu-donate"])
def test_a_compiled_cache_write_is_seen_and_kept(tpu, backend):
    """Each backend's program writes one position of a cache and reads the slot back: the read sees the
    write, the cache keeps every call's write and nothing else changes (donated: updated in place)."""
    import torch

    from tpuray.serve.llm.engine.embedded.tpu_compile import lookup

    def step(cache, slots, pos, k):
        cache.index_put_((slots, pos), k)
        return cache[slots, :8].clone()

    fn = torch.compile(step, backend=lookup(backend), dynamic=False, fullgraph=True)
    cache, slots = torch.zeros(3, 16, 2, 4, device="tpu"), torch.tensor([0], device="tpu")
    for trial in range(3):
        k = torch.full((1, 2, 4), float(trial + 1), device="tpu")
        read = fn(cache, slots, torch.tensor([trial + 2], device="tpu"), k).cpu()
        assert bool((read[0, trial + 2] == trial + 1).all())
    want = torch.zeros(3, 16, 2, 4)
    for trial in range(3):
        want[0, trial + 2] = trial + 1
    assert torch.equal(cache.cpu(), want)
