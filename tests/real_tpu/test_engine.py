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


def _greedy(runner: ModelRunner, prompt: list[int], n: int, ahead: bool = False) -> list[int]:
    """`n` greedy tokens; `ahead` (async scheduling): each step launched before the previous one is
    read back, its token taken from that step's ids on the device."""
    pending, out = runner.launch([(0, prompt, 0, None)], need_logits=False), []
    for i in range(n - 1):
        if ahead:
            launched = runner.launch([(0, [FROM_DEVICE], len(prompt) + i, None)], need_logits=False)
        res = runner.collect(pending)
        assert res is not None
        out.append(res.token_ids[0])
        if not ahead:
            launched = runner.launch([(0, [out[-1]], len(prompt) + i, None)], need_logits=False)
        pending = launched
    res = runner.collect(pending)
    assert res is not None
    return [*out, res.token_ids[0]]


def test_greedy_tokens_equal_cpu_and_no_compilation_after_warmup(tpu, trained_model, highest_precision):
    kw = dict(max_num_seqs=4, max_model_len=256, dtype="float32")
    cpu = ModelRunner(trained_model, **kw)
    chip = ModelRunner(trained_model, device="tpu", **kw)
    assert chip.compiled and not cpu.compiled
    built = chip.warmup()
    assert built == chip.buckets.num_programs
    prompt = list(range(5, 17))
    want = _greedy(cpu, prompt, 64)
    assert _greedy(chip, prompt, 64) == want
    assert _greedy(chip, prompt, 64, ahead=True) == want  # async scheduling: ids stay on the chip
    rng = random.Random(0)  # mixed prompt lengths and batch sizes: every shape is a warmed-up bucket
    for _ in range(20):
        step = [(s, [rng.randrange(3, 100) for _ in range(rng.randrange(1, 60))], 0, None) for s in range(4)]
        res = chip.step(step, need_logits=rng.random() < 0.5)
        assert res is not None and len(res.token_ids) == 4
    assert chip.compilations == built
