"""Ray Serve LLM ITSELF (`ray.serve.llm`, not tpuray's) on an emulated v6e slice, unchanged: the
announcement's LLMConfig with a TPU accelerator_config, vLLM's CPU build underneath. tpuray's emulator
makes vLLM's platform the emulated TPU one on every node, so Ray's TPU serving path reserves the slice and
puts one vLLM worker on each emulated chip. A 1x1 slice (tensor_parallel_size 1): a 2x2 slice with TP=4
passes the same way (run it with `topology="2x2"` and TP 4) but costs CI ~1 minute more; tpuray's own
vLLM path at TP=4 over a 2x2 slice runs in test_vllm.py."""

from __future__ import annotations

import httpx
import pytest

from _util import live_placement_groups, new_placement_groups
from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = [
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install 'tpuray[vllm]')"),
    pytest.mark.full(
        "CI: tpuray's own OpenAI app on vLLM over an emulated slice (serve/backends/test_vllm.py)"
    ),
]


def test_ray_serve_llm_serves_on_the_emulated_slice(serve_url, tmp_path) -> None:
    import torch
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpuray.models import build_tiny_causal_lm

    path = str(
        build_tiny_causal_lm(
            tmp_path / "m", hidden_size=256, num_attention_heads=4, max_position_embeddings=512
        )
    )
    llm_config = LLMConfig(  # the announcement's config, with a local tiny model
        model_loading_config=dict(model_id="tiny", model_source=path),
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "1x1"},
        placement_group_config={"bundle_per_worker": {"TPU": 1}},
        engine_kwargs={
            "tensor_parallel_size": 1,
            "max_model_len": 256,
            "dtype": "float32",
            "enforce_eager": True,
        },
    )
    before = set(live_placement_groups())
    try:
        serve.run(build_openai_app({"llm_configs": [llm_config]}), name="ray-serve-llm", route_prefix="/")
        body = {
            "model": "tiny",
            "prompt": "Hello world",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{serve_url}/v1/completions", json={**body, "return_token_ids": True}, timeout=300)
        assert r.status_code == 200, r.text
        slices = [
            v
            for k, v in live_placement_groups().items()
            if k not in before and any("TPU" in b for b in v["bundles"].values())
        ]
        assert slices and all(
            b.get("TPU") == 1.0 for b in slices[0]["bundles"].values()
        )  # one chip per worker
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok("Hello world", return_tensors="pt").input_ids
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(path).generate(
                ids, do_sample=False, max_new_tokens=8, min_new_tokens=8
            )
        assert r.json()["choices"][0]["token_ids"] == ref[0, ids.shape[1] :].tolist()
    finally:
        serve.delete("ray-serve-llm")
    assert not new_placement_groups(before, timeout_s=60)
