"""The embedded engine in this process (no Ray): HF-exact forward, KV cache, continuous batching, sampling."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tpuray.serve.llm import LLMConfig
from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine
from tpuray.serve.llm.engine.embedded.model import ShardedLlama
from tpuray.serve.llm.engine.embedded.sampling import sample_batch
from tpuray.serve.llm.generation import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    cfg = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
        llm_engine="embedded",
        engine_kwargs={"max_model_len": 128, "max_num_seqs": 8},
    )
    eng = EmbeddedEngine(cfg)
    yield eng
    eng.shutdown()


def run(engine, prompt, **kw):
    async def go():
        text, last = "", None
        async for out in engine.generate(engine.encode_prompt(prompt), SamplingParams(**kw)):
            text += out.text
            last = out
        return text, last.finish_reason, last.completion_tokens

    return asyncio.run(go())


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory):
    """A tiny model with grouped-query attention (16 query heads over 4 KV heads)."""
    from tpuray.models import build_tiny_causal_lm

    return str(build_tiny_causal_lm(tmp_path_factory.mktemp("gqa"), num_key_value_heads=4))


@pytest.mark.parametrize("model", ["tiny_model_dir", "gqa_model_dir"])
def test_forward_matches_transformers_with_kv_cache(model, request):
    from transformers import AutoModelForCausalLM

    from tpuray.serve.llm.engine.embedded.step_plan import Buckets, decode_batches, pack_prefills

    path = request.getfixturevalue(model)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    m = ShardedLlama(path)
    for buckets in (Buckets.exact(), Buckets.for_engine(4, 64, 64)):  # exact sizes, then padded ones
        cache = m.new_kv_cache(num_slots=4, max_model_len=64)
        # two prompts packed in one prefill, then three batched decode steps
        step = [(0, [5, 6, 7, 8], 0, None), (3, [5, 6], 0, None)]
        p = pack_prefills(step, [0, 1], buckets, cache.trash_slot)[0]
        first = m.prefill(*p.inputs(), cache)
        for t in range(3):
            step = [(0, [9 + t], 4 + t, None), (3, [7 + t], 2 + t, None)]
            d = decode_batches(step, [0, 1], buckets, cache.trash_slot)[0]
            out = m.decode(*d.packed, cache, d.context_len)
        with torch.no_grad():
            ref = [
                hf(torch.tensor([ids])).logits[0, -1] for ids in ([5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9])
            ]
            ref_first = hf(torch.tensor([[5, 6]])).logits[0, -1]
        torch.testing.assert_close(first[1], ref_first, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[1], ref[1], atol=1e-4, rtol=1e-4)


def test_concurrent_equals_sequential(engine):
    prompts = [f"Request number {i} says hello" for i in range(12)]  # more than max_num_seqs=8 slots
    sequential = [run(engine, p, max_tokens=10, temperature=0) for p in prompts]

    async def concurrent():
        async def one(p):
            text = ""
            async for out in engine.generate(
                engine.encode_prompt(p), SamplingParams(max_tokens=10, temperature=0)
            ):
                text += out.text
            return text

        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(concurrent()) == [s[0] for s in sequential]
    assert all(s[1] in ("length", "stop") for s in sequential)
    assert not engine.scheduler.running and len(engine.scheduler.free_slots) == 8


def test_seed_is_reproducible_and_limits_apply(engine):
    a = run(engine, "The quick brown fox", max_tokens=12, temperature=1.0, seed=7)
    b = run(engine, "The quick brown fox", max_tokens=12, temperature=1.0, seed=7)
    c = run(engine, "The quick brown fox", max_tokens=12, temperature=1.0, seed=8)
    assert a == b and a != c
    assert a[1] == "length" and a[2] == 12
    top = run(engine, "The quick brown fox", max_tokens=12, temperature=1.0, top_p=1e-6, seed=1)
    greedy = run(engine, "The quick brown fox", max_tokens=12, temperature=0)
    assert top == greedy  # top_p -> 0 keeps only the most likely token


def test_stop_strings(engine):
    full, _, _ = run(engine, "Hello", max_tokens=30, temperature=0)
    stop = full[5:7]
    assert stop and stop in full
    text, reason, _ = run(engine, "Hello", max_tokens=30, temperature=0, stop=[stop])
    assert reason == "stop" and text == full[: full.index(stop)]


def test_batched_sampling_matches_the_distribution_and_is_per_row_seeded():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()
    n = 20000
    for top_p, want in ((1.0, probs), (0.5, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))):
        params = [SamplingParams(temperature=1.0, top_p=top_p)] * n
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        tokens = sample_batch(logits.expand(n, 4), params, gens)
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
        assert torch.allclose(freq, want, atol=0.015), (top_p, freq)
    # a seeded row samples the same token alone or next to other rows; temperature 0 rows are argmax
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)]
    batch = torch.randn(2, 512)
    alone = sample_batch(batch[1:], mixed[1:], [mixed[1].generator()])
    together = sample_batch(batch, mixed, [mixed[0].generator(), mixed[1].generator()])
    assert together == [int(batch[0].argmax()), alone[0]]


def test_incremental_detokenization_equals_decoding_everything(tiny_model_dir):
    """Random token streams (special tokens and lone UTF-8 bytes included): the deltas the scheduler
    emits, decoding only a small window per token, add up to decoding the whole output at once."""
    import random

    from transformers import AutoTokenizer

    from tpuray.serve.llm.engine.embedded.scheduler import Scheduler, Sequence

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ascii_text = tok.encode("Hello, wörld: naïve café ✓ 🙂 tensor parallel", add_special_tokens=False)
    rng = random.Random(0)
    for trial in range(40):
        sched = Scheduler(tok, eos_ids=set(), max_num_seqs=1, max_model_len=512)
        pool = ascii_text if trial % 2 else range(len(tok))
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        seq = Sequence([1], SamplingParams(max_tokens=len(ids)), torch.Generator(), asyncio.Queue())
        deltas = []
        for i, token in enumerate(ids):
            seq.output_ids.append(token)
            sched._emit(seq, "length" if i == len(ids) - 1 else None)
            while not seq.queue.empty():
                deltas.append(seq.queue.get_nowait().text)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), (trial, ids)


def test_generate_after_shutdown_is_a_clear_error(tiny_model_dir):
    from tpuray.serve.llm.engine.embedded.engine import EngineShutDownError

    cfg = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
        llm_engine="embedded",
        engine_kwargs={"max_model_len": 64, "max_num_seqs": 2},
    )
    eng = EmbeddedEngine(cfg)
    assert run(eng, "ab", max_tokens=2, temperature=0)[2] == 2
    eng.shutdown()
    eng.shutdown()  # idempotent
    with pytest.raises(EngineShutDownError, match="'tiny' is shut down"):
        run(eng, "ab", max_tokens=2, temperature=0)
