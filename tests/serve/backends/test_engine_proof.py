"""A model the engine cannot run is refused or rerouted before anything serves it (issue 22, item 1).

vLLM's CPU attention takes head sizes 32, 64, ... only; the tiny test model (hidden 128, 16 heads) has
head_dim 8. Under llm_engine "auto" it goes to the embedded engine with a warning saying why; with
llm_engine "vLLM" the app fails to build, naming head_dim and vLLM's valid sizes. Anything else that
kills an engine at its first request is caught by the warm-up generation at replica start: started
past the config check, vLLM's engine core dies in start(), not behind a live endpoint.
(test_http_fuzz.py serves the head_dim 8 model under "auto" over HTTP.)"""

from __future__ import annotations

import logging

import pytest

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (pip install 'tpuray[vllm]')"
)

KWARGS = {"max_model_len": 128, "dtype": "float32", "enforce_eager": True}


def config(model_dir: str, engine: str, fields: dict | None = None, **kwargs):
    from tpuray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": "tiny-hd8", "model_source": model_dir},
        llm_engine=engine,
        engine_kwargs={**KWARGS, **kwargs},
        **(fields or {}),
    )


def test_auto_serves_a_model_vllm_cannot_run_with_the_embedded_engine(tiny_model_dir, caplog):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = config(tiny_model_dir, "auto")
    assert cfg.engine == "vLLM"  # before the model is read: vLLM is installed
    with caplog.at_level(logging.WARNING, logger="tpuray.serve.llm.config"):
        cfg.check_model_source()
    assert cfg.engine == "embedded"
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    assert 8 not in sizes
    assert "serves it with the embedded engine, not vLLM" in caplog.text
    assert "head_dim=8 (hidden_size=128, num_attention_heads=16)" in caplog.text
    assert f"valid head sizes: {sizes}" in caplog.text
    # the embedded engine's own limits still apply to what auto hands it
    v6e_2x2 = {"accelerator_type": "TPU-V6E", "accelerator_config": {"kind": "tpu", "topology": "2x2"}}
    cfg = config(tiny_model_dir, "auto", v6e_2x2, pipeline_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match=r"head_dim=8.*embedded engine cannot take.*pipeline_parallel_size=2"
    ):
        cfg.check_model_source()


def test_explicit_vllm_fails_at_build_naming_the_head_size(tiny_model_dir):
    from tpuray.serve.llm import LLMServingArgs, build_openai_app

    match = (
        r"llm_engine='vLLM' cannot serve model 'tiny-hd8': head_dim=8 \(hidden_size=128, "
        r"num_attention_heads=16\) is not supported by vLLM's CPU attention backend .*valid head sizes: \[32, 64"
    )
    with pytest.raises(ValueError, match=match):
        build_openai_app(LLMServingArgs(llm_configs=[config(tiny_model_dir, "vLLM")]))


def test_a_model_vllm_can_run_keeps_vllm(tmp_path):
    from tpuray.models import build_tiny_causal_lm

    path = str(build_tiny_causal_lm(tmp_path / "hd32", hidden_size=64, num_attention_heads=2))
    cfg = config(path, "auto")
    cfg.check_model_source()
    assert cfg.engine == "vLLM"


WARM_UP_CHILD = """
import asyncio, json, os, sys
from tpuray.serve.llm import LLMConfig
from tpuray.serve.llm.backends.vllm import VLLMBackend
cfg = LLMConfig(model_loading_config={"model_id": "tiny-hd8", "model_source": sys.argv[1]},
                llm_engine="vLLM", engine_kwargs=json.loads(sys.argv[2]))
server = VLLMBackend(cfg)
try:
    asyncio.run(server.start())
    outcome = "STARTED"
except RuntimeError as e:
    outcome = f"REFUSED {e}"
finally:
    with open(sys.argv[3], "w") as f:  # not stdout: vLLM's processes log there too, interleaved
        f.write(outcome)
    server.shutdown()
    os._exit(0)  # the dead engine's zmq context would block the interpreter's exit
"""


def test_warm_up_catches_an_engine_that_dies_at_its_first_request(tiny_model_dir, tmp_path):
    """Past the config check (the backend built directly), vLLM starts for the head_dim 8 model and its
    engine core dies at the first generation: that is the warm-up in start(), so no replica serves it.
    In a child process: vLLM's client of a dead engine core leaves a zmq context whose clean-up blocks
    forever when garbage-collected (a replica whose start failed exits; this test process must not)."""
    import json
    import os
    import subprocess
    import sys

    result = tmp_path / "outcome.txt"
    out = subprocess.run(
        [sys.executable, "-c", WARM_UP_CHILD, tiny_model_dir, json.dumps(KWARGS), str(result)],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ),
    )
    outcome = result.read_text() if result.exists() else ""
    assert outcome.startswith("REFUSED"), (outcome, out.stdout[-2000:], out.stderr[-3000:])
    assert "the vLLM engine failed its warm-up generation" in outcome
    assert "EngineDeadError" in outcome and "'tiny-hd8'" in outcome
