"""vLLM-TorchTPU's second start on the real chip (tpuray.serve.llm.engine.vllm.kv_budget): the first start
of tpuray's VLLMEngine records its KV cache budget under TPURAY_COMPILE_CACHE; a second start in a fresh
process sizes its KV cache alike (the same block count, which vLLM-TorchTPU's compile key holds), so it
loads the compiled model from vLLM's cache instead of compiling it, and gives the same greedy tokens
(first in the suite: child processes open the chip only while this process does not hold it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (vLLM-TorchTPU) is not installed")

# A start of tpuray's VLLMEngine in this child process (vLLM's engine core in it too), on the tiny model at
# the path (built there first if missing); prints one JSON line: the KV cache's block count, vLLM's
# compilation counters, 8 greedy tokens.
VLLM_START = """
import asyncio, json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
path = sys.argv[1]
if not os.path.exists(os.path.join(path, "config.json")):  # built here: on a TPU VM one process holds the chip
    from tpuray.models import build_tiny_causal_lm
    build_tiny_causal_lm(path, max_position_embeddings=512)
from vllm import SamplingParams
from vllm.compilation.counter import compilation_counter
from tpuray.serve.llm import LLMConfig
from tpuray.serve.llm.engine.vllm.engine import VLLMEngine
kwargs = {"max_model_len": 256, "max_num_seqs": 4, "dtype": "bfloat16", "gpu_memory_utilization": 0.3}
engine = VLLMEngine(LLMConfig(model_loading_config={"model_id": "tiny", "model_source": path},
                              llm_engine="vLLM", engine_kwargs=kwargs))
async def greedy():
    async for out in engine.client.generate({"prompt_token_ids": [5, 6, 7, 8]},
                                            SamplingParams(max_tokens=8, temperature=0.0), "greedy"):
        final = out
    return list(final.outputs[0].token_ids)
c = compilation_counter
print("START " + json.dumps({"blocks": engine.vllm_config.cache_config.num_gpu_blocks,
      "aot_compiles": c.num_aot_compiles, "aot_loaded": c.num_aot_artifacts_loaded,
      "graphs_compiled": c.num_cache_entries_updated, "tokens": asyncio.run(greedy())}))
engine.shutdown()
"""


def _start(model: str, cache: str) -> dict:
    env = dict(os.environ, TPURAY_COMPILE_CACHE=cache)
    out = subprocess.run(
        [sys.executable, "-c", VLLM_START, model], env=env, capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0 and "START " in out.stdout, (out.stdout[-2000:], out.stderr[-6000:])
    return json.loads(out.stdout.split("START ", 1)[1].splitlines()[0])


def test_a_second_vllm_start_sizes_its_kv_cache_alike_and_loads_the_compiled_model(tmp_path):
    model, cache = str(tmp_path / "model"), str(tmp_path / "compile-cache")
    first = _start(model, cache)
    records = list((tmp_path / "compile-cache" / "vllm-kv").glob("*.json"))
    assert len(records) == 1, records
    print(f"first start: {first}; record: {records[0].read_text()}")
    assert first["aot_compiles"] >= 1 and first["graphs_compiled"] >= 1
    second = _start(model, cache)
    print(f"second start: {second}")
    assert second["blocks"] == first["blocks"]
    assert second["graphs_compiled"] == 0 and second["aot_compiles"] == 0
    assert second["aot_loaded"] == first["aot_compiles"]
    assert second["tokens"] == first["tokens"]
