"""vLLM's KV cache sized alike at every start (tpuray.serve.llm.engine.vllm.kv_budget), on real vLLM CPU
engines in this process (no Ray): the first start records its budget (measured less MARGIN), a second
start sizes its KV cache by it; a record that no longer fits, cannot be read or belongs to another engine
is measured again and replaced; engine_kwargs that size the KV cache win; the executor crosses into
vLLM's engine-core process (spawn). vLLM's CPU backend measures VLLM_CPU_KVCACHE_SPACE (1 GiB here)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (pip install 'tpuray[vllm]')"
)

GIB = 1 << 30
ENGINE_KWARGS = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tpuray.models import build_tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny-vllm") / "model"  # head_dim 64: vLLM's CPU attention takes it
    return str(
        build_tiny_causal_lm(path, hidden_size=256, num_attention_heads=4, max_position_embeddings=512)
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The host's compilation cache of this module's engines, and vLLM in this process."""
    root = tmp_path_factory.mktemp("compile-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPURAY_COMPILE_CACHE", str(root))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield root


def start(model_dir: str, record: bool = True, **engine_kwargs) -> int:
    """Start and stop a vLLM engine; the number of KV cache blocks vLLM gave it."""
    import vllm.envs

    from tpuray.serve.llm import LLMConfig
    from tpuray.serve.llm.engine.vllm.engine import VLLMEngine

    vllm.envs.disable_envs_cache()  # vLLM caches its env at an engine's start; each start here reads it
    config = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": model_dir},
        llm_engine="vLLM",
        engine_kwargs={**ENGINE_KWARGS, **engine_kwargs},
    )
    engine = VLLMEngine(config, record_kv_budget=record)
    try:
        return int(engine.vllm_config.cache_config.num_gpu_blocks)
    finally:
        engine.shutdown()


def records(cache: Path) -> dict[Path, dict]:
    return {p: json.loads(p.read_text()) for p in sorted((cache / "vllm-kv").glob("*.json"))}


@pytest.fixture(scope="module")
def first(model_dir, cache) -> tuple[int, Path]:
    """The first start (nothing recorded): its block count and its record."""
    blocks = start(model_dir)
    (path,) = records(cache)
    return blocks, path


def test_choose_budget_keeps_a_recorded_budget_within_the_band_below_the_memory_measured():
    from tpuray.serve.llm.engine.vllm.kv_budget import BAND, MARGIN, choose_budget

    measured = 12 * GIB
    fresh = int(measured * (1 - MARGIN))
    assert choose_budget(measured, None) == fresh
    assert choose_budget(measured, fresh - 5) == fresh - 5  # an earlier start measured a little less
    assert choose_budget(measured, measured) == measured
    assert choose_budget(measured, int(measured * (1 - BAND))) == int(measured * (1 - BAND))
    assert choose_budget(measured, measured + 1) == fresh  # more than is free now: measured again
    assert choose_budget(measured, int(measured * (1 - BAND)) - 1) == fresh  # far less: sized anew


def test_the_first_start_records_its_budget_and_a_second_start_sizes_its_kv_cache_by_it(model_dir, first):
    from tpuray.serve.llm.engine.vllm.kv_budget import MARGIN

    blocks, path = first
    record = json.loads(path.read_text())
    assert record["measured_bytes"] == [GIB]
    assert record["kv_cache_bytes"] == int(GIB * (1 - MARGIN))
    assert start(model_dir) == blocks
    assert json.loads(path.read_text()) == record
    unrecorded = start(model_dir, record=False)  # vLLM's own sizing: all that was measured
    assert blocks < unrecorded


@pytest.mark.parametrize(
    "damage",
    ["more than is free now", "not JSON", "another engine's key", "not a number"],
)
def test_a_record_that_does_not_fit_or_cannot_be_used_is_measured_again(
    model_dir, cache, first, damage, caplog
):
    blocks, path = first
    good = json.loads(path.read_text())
    bad = dict(good)
    if damage == "more than is free now":
        bad["kv_cache_bytes"] = 2 * GIB
    elif damage == "another engine's key":
        bad["key"] = {**good["key"], "model": "/elsewhere"}
    elif damage == "not a number":
        bad["kv_cache_bytes"] = "1 GiB"
    path.write_text("{ not json" if damage == "not JSON" else json.dumps(bad))
    with caplog.at_level(logging.INFO, logger="tpuray.serve.llm.engine.vllm.kv_budget"):
        assert start(model_dir) == blocks
    assert json.loads(path.read_text()) == good
    said = "no longer fits" if damage == "more than is free now" else "ignored"
    assert any(said in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_a_kv_cache_sized_by_engine_kwargs_is_left_alone(model_dir, cache, first):
    before = records(cache)
    assert start(model_dir, num_gpu_blocks_override=100) == 100
    assert records(cache) == before


def test_the_executor_crosses_into_vllms_engine_core_process(model_dir, cache, first, monkeypatch):
    """vLLM's engine core a child process started with spawn: the class goes there by name, and the child
    records and sizes the KV cache as this process does."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    blocks, _ = first
    assert start(model_dir) == blocks
    assert all(r["measured_bytes"] == [GIB] for r in records(cache).values())
