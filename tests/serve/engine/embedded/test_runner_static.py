"""The embedded engine's fixed-shape step (what XLA needs on a real TPU), checked on CPU: padded steps give
the exact steps' results, and a compiled runner builds all its programs at warm-up and none afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tpuray.serve.llm import LLMConfig
from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine
from tpuray.serve.llm.engine.embedded.model import prefill_mask
from tpuray.serve.llm.engine.embedded.runner import ModelRunner, warmup_prefill
from tpuray.serve.llm.engine.embedded.step_plan import (
    Buckets,
    PrefillPack,
    decode_batches,
    pack_prefills,
    powers_of_two,
)
from tpuray.serve.llm.generation import SamplingParams


def test_buckets_pick_and_pack():
    assert powers_of_two(1, 8) == (1, 2, 4, 8) and powers_of_two(16, 100) == (16, 32, 64, 100)
    b = Buckets.for_engine(max_num_seqs=6, max_model_len=2048, max_prefill_tokens=2048)
    assert (
        b.batch == (1, 6) and b.context == (256, 1024, 2048) and b.tokens == (64, 128, 256, 512, 1024, 2048)
    )
    wide = Buckets.for_engine(max_num_seqs=32, max_model_len=1024, max_prefill_tokens=1024)
    assert (
        wide.batch == (1, 8, 16, 32) and wide.num_programs == 5 + 4 * 2
    )  # 13 (19 with batch 2, 4 and packs 16, 32)
    assert Buckets.for_engine(1, 32, 32).batch == (1,) and Buckets.for_engine(1, 32, 32).tokens == (32,)
    assert Buckets.pick(5, b.batch) == 6 and Buckets.pick(7, ()) == 7
    with pytest.raises(ValueError, match="exceeds the largest bucket 6"):
        Buckets.pick(7, b.batch)
    step = [(i, list(range(1, 700)), 0, None) for i in range(4)]  # 4 prompts of 699 tokens
    packs = pack_prefills(step, [0, 1, 2, 3], b, trash_slot=6)
    assert [p.rows for p in packs] == [[0, 1], [2, 3]]  # 2 x 699 fits 2048, a third does not
    p = packs[0]
    tokens, _, segments, slots, last_index = p.inputs()
    assert tokens.shape == (2048,) and last_index.tolist()[:3] == [698, 1397, 0]
    assert slots[1398:].eq(6).all() and segments[1398:].eq(-1).all()
    d = decode_batches([(3, [9], 300, None)], [0], b, trash_slot=6)[0]
    assert d.packed[0].shape == (1,) and d.context_len == 1024


@pytest.mark.parametrize("max_model_len", [1024, 129])  # 129 = 2^7 + 1: T - 1 tokens fit the 128 bucket
def test_warmup_prefill_masks_are_not_causal(max_model_len):
    """Each token bucket is compiled on a pack whose attention mask is not lower-triangular: torch_tpu's
    compiler would otherwise make that bucket's program causal for good (runner.warmup_prefill)."""
    buckets = Buckets.for_engine(8, max_model_len, max_model_len)
    for T in buckets.tokens:
        pack = warmup_prefill(T, buckets, trash_slot=8)
        assert pack.packed.shape[1] == T  # the bucket it compiles
        tokens, positions, segments, slots, last = PrefillPack.unpack(pack.packed, pack.num_prompts)
        mask = prefill_mask(positions, segments)[0, 0]
        assert not torch.equal(mask, torch.tril(torch.ones(T, T, dtype=torch.bool)))
    # a prompt that fills its bucket does make a causal mask: what warm-up must avoid
    full = pack_prefills([(8, [0] * 64, 0, None)], [0], buckets, 8)[0]
    _, positions, segments, _, _ = PrefillPack.unpack(full.packed, full.num_prompts)
    assert torch.equal(
        prefill_mask(positions, segments)[0, 0], torch.tril(torch.ones(64, 64, dtype=torch.bool))
    )


def _random_steps(seed: int, n: int = 12):
    """Steps of a small workload: prompts of 1..40 tokens joining while others decode."""
    rng = random.Random(seed)
    free, running, steps = list(range(4)), {}, []
    for _ in range(n):
        step = [(slot, [rng.randrange(3, 200)], pos, None) for slot, pos in running.items()]
        while free and rng.random() < 0.6:
            slot, ids = free.pop(), [rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))]
            step.append((slot, ids, 0, None))
            running[slot] = len(ids) - 1
        running = {s: p + 1 for s, p in running.items()}
        if step:
            steps.append(step)
    return steps


@pytest.mark.parametrize(
    "tpu_options",
    [{}, {"kv_write": "dense", "decode_attention": "matmul"}],
    ids=["default", "dense-write-matmul-attention"],
)
def test_padded_steps_equal_exact_steps(tiny_model_dir, tpu_options):
    """Padded steps give the exact steps' results, also with the decode step a real TPU runs (its K/V
    written densely at every batch size, its attention as matmuls)."""
    kw = dict(max_num_seqs=4, max_model_len=128, dtype="float32")
    exact = ModelRunner(tiny_model_dir, **kw)
    padded = ModelRunner(tiny_model_dir, static_shapes=True, **tpu_options, **kw)
    assert padded.buckets.padded and not exact.buckets.padded
    for step in _random_steps(0):
        a, b = exact.step(step), padded.step(step)
        assert a is not None and b is not None and a.logits is not None and b.logits is not None
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
        assert a.token_ids == b.token_ids == a.logits.argmax(-1).tolist()
    greedy_only = padded.step(_random_steps(1)[0], need_logits=False)
    assert greedy_only is not None and greedy_only.logits is None and greedy_only.token_ids


def test_runner_options_are_checked(tiny_model_dir):
    kw = dict(max_num_seqs=4, max_model_len=128, dtype="float32")
    with pytest.raises(ValueError, match="kv_write='sparse' is not valid; valid: 'auto', 'scatter', 'dense'"):
        ModelRunner(tiny_model_dir, kv_write="sparse", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_attention='flash' is not valid; valid: 'sdpa', 'matmul'"):
        ModelRunner(tiny_model_dir, decode_attention="flash", **kw)  # type: ignore[arg-type]
    cpu = ModelRunner(tiny_model_dir, **kw)  # off a TPU "auto" keeps the scatter and SDPA
    assert cpu.kv_write == "scatter" and cpu.model.decode_attention == "sdpa"


@pytest.mark.parametrize(
    "tpu_options", [{}, {"kv_write": "dense", "decode_attention": "matmul"}], ids=["default", "tpu-decode"]
)
def test_a_stale_slot_changes_nothing(tiny_model_dir, tpu_options):
    """Keys and values a slot holds beyond its sequence (a finished request's, or garbage) are masked out:
    the same logits as in a fresh slot. On torch_tpu 0.2.0 a decode mask that broadcast over the query
    rows was ignored (the cache probe, benchmarks/notes/real-tpu.md); the model expands it (tests/real_tpu compares)."""
    runner = ModelRunner(
        tiny_model_dir, max_num_seqs=4, max_model_len=128, dtype="float32", static_shapes=True, **tpu_options
    )
    prompt = list(range(5, 17))
    for t in (*runner.cache.k, *runner.cache.v):
        t[1, len(prompt) :] = 50.0
    for i in range(6):
        step = (
            [(0, prompt, 0, None), (1, prompt, 0, None)]
            if i == 0
            else [(s, [7 + i], 11 + i, None) for s in (0, 1)]
        )
        res = runner.step(step)
        assert res is not None and res.logits is not None
        torch.testing.assert_close(res.logits[0], res.logits[1], atol=1e-5, rtol=1e-5)


def _config(model_dir: str, **engine_kwargs) -> LLMConfig:
    return LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": model_dir},
        llm_engine="embedded",
        engine_kwargs={"max_model_len": 128, "max_num_seqs": 4, "dtype": "float32", **engine_kwargs},
    )


def _engine(model_dir: str, async_scheduling: bool | None = None, **runner_options) -> EmbeddedEngine:
    return EmbeddedEngine(
        _config(model_dir, async_scheduling=async_scheduling), runner_options=runner_options
    )


def _serve(engine: EmbeddedEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    async def one(ids, params):
        out: list[int] = []
        async for chunk in engine.generate(ids, params):
            out += chunk.token_ids
        return out

    async def all_of_them():
        return await asyncio.gather(*(one(ids, p) for ids, p in requests))

    return asyncio.run(all_of_them())


def test_compiled_runner_compiles_only_at_warmup(tiny_model_dir):
    rng = random.Random(7)
    requests = []
    for i in range(40):  # mixed prompt and output lengths, greedy and sampled, more than max_num_seqs
        ids = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 60))]
        temp = 0.0 if i % 3 else 0.8
        requests.append((ids, SamplingParams(max_tokens=rng.randrange(1, 40), temperature=temp, seed=i)))
    compiled = _engine(  # with the decode step a real TPU runs: K/V written densely, matmul attention
        tiny_model_dir,
        True,
        compile=True,
        compile_backend="eager",
        kv_write="dense",
        decode_attention="matmul",
    )
    try:
        runner = compiled.runner
        assert runner is not None and runner.compiled and compiled.async_scheduling
        assert runner.kv_write == "dense" and runner.model.decode_attention == "matmul"
        assert runner.backend == "eager"
        after_warmup = runner.compilations
        assert after_warmup == runner.buckets.num_programs  # every program built before serving
        got = _serve(compiled, requests)
        assert runner.compilations == after_warmup  # 0 compilations while serving
        assert compiled.pipeline is not None and compiled.pipeline.steps_ahead > 0
    finally:
        compiled.shutdown()
    eager = _engine(tiny_model_dir)
    try:
        assert eager.runner is not None and not eager.runner.compiled and eager.runner.compilations == 0
        assert eager.runner.backend is None and eager.runner.kv_write == "scatter"
        assert _serve(eager, requests) == got  # the same tokens, seeded sampling included
    finally:
        eager.shutdown()


def _streams(engine: EmbeddedEngine, requests: list[tuple[list[int], SamplingParams]], late: int) -> list:
    """Every request's stream of chunks (tokens, text, finish reason, tokens counted). The last `late`
    requests are added once the first one has streamed 3 tokens: they join while others decode."""

    async def one(ids, params, gate=None, started=None):
        if gate is not None:
            await gate.wait()
        chunks = []
        async for c in engine.generate(ids, params):
            chunks.append((c.token_ids, c.text, c.finish_reason, c.completion_tokens))
            if started is not None and sum(len(t) for t, *_ in chunks) >= 3:
                started.set()
        return chunks

    async def all_of_them():
        started = asyncio.Event()
        first = one(*requests[0], started=started)
        now = [one(ids, p) for ids, p in requests[1 : len(requests) - late]]
        later = [one(ids, p, gate=started) for ids, p in requests[len(requests) - late :]]
        return await asyncio.gather(first, *now, *later)

    return asyncio.run(all_of_them())


def test_async_scheduling_streams_equal_sync(tiny_model_dir):
    """Async scheduling (a greedy step launched before the previous one is read back, its tokens taken
    on the device) streams exactly what the synchronous loop streams: stop tokens and strings end a
    sequence whose extra token is discarded, max_tokens and sampled steps (read back first) included."""
    sync, ahead = _engine(tiny_model_dir, async_scheduling=False), _engine(tiny_model_dir)
    try:
        assert not sync.async_scheduling and ahead.async_scheduling  # the default: on (vLLM's)
        prompt, rng = list(range(5, 17)), random.Random(0)
        first, late = [100, 101, 102], [rng.randrange(3, 200) for _ in range(20)]
        probe = _serve(sync, [(first, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))])[0]
        at = next(i for i in range(3, len(probe)) if probe[i] not in probe[:i])  # stops after `at` tokens
        requests = [
            (first, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[probe[at]])),
            (prompt[:7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),  # max_tokens
            ([9], SamplingParams(max_tokens=5, temperature=0.0)),  # a one-token prompt decodes at once
            (prompt[:2], SamplingParams(max_tokens=1, temperature=0.0)),
            ([rng.randrange(3, 200) for _ in range(50)], SamplingParams(max_tokens=17, temperature=0.0)),
            (prompt[3:], SamplingParams(max_tokens=12, temperature=0.8, seed=5)),  # sampled: read back
            ([rng.randrange(3, 200) for _ in range(30)], SamplingParams(max_tokens=9, temperature=0.0)),
            (late, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),  # joins later
        ]
        want = _streams(sync, requests, late=1)
        assert want[0][-1][2] == "stop" and want[0][-1][3] == at  # the stop token ended it
        assert want[1][-1][2:] == ("length", 40)
        text = "".join(c[1] for c in want[7])  # a stop string from the late request's own text
        requests[7] = (requests[7][0], SamplingParams(max_tokens=20, temperature=0.0, stop=[text[6:9]]))
        want[7] = _streams(sync, [requests[7]], late=0)[0]
        assert want[7][-1][2] == "stop"
        assert _streams(ahead, requests, late=1) == want
        assert ahead.pipeline is not None and ahead.pipeline.steps_ahead > 0
        assert sync.pipeline is not None and sync.pipeline.steps_ahead == 0
    finally:
        sync.shutdown()
        ahead.shutdown()
