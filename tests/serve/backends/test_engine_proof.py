"""A model the engine cannot run is refused or rerouted before anything serves it (issue 22, item 1).

vLLM's CPU attention takes head sizes 32, 64, ... only; the tiny test model (hidden 128, 16 heads) has
head_dim 8. Under llm_engine "auto" it goes to the embedded engine with a warning saying why; with
llm_engine "vLLM" the app fails to build, naming head_dim and vLLM's valid sizes. Anything else that
kills an engine at its first request is caught by the warm-up generation at replica start: started
past the config check, vLLM's engine core dies in start(), not behind a live endpoint.
(test_http_fuzz.py serves the head_dim 8 model under "auto" over HTTP.) With vLLM's engine core in the
replica's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as on a one-chip TPU VM) the same holds, and OpenAI
fields reach vLLM as they do through its engine-core process."""

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


@pytest.mark.full(
    "CI: the same warm-up refusal with vLLM's engine core in process "
    "(test_vllm_in_process_serves_and_refuses_like_its_engine_core_process)"
)
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


IN_PROCESS_CHILD = """
import asyncio, json, multiprocessing, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tpuray.serve.llm import LLMConfig
from tpuray.serve.llm.deployments.server import LLMServer
from tpuray.serve.llm.backends.vllm import VLLMBackend
hd32, hd8, out_path = sys.argv[1:4]
PROMPT = "Ray schedules tasks"
kwargs = json.loads(sys.argv[4])
result = {}

def config(path, model_id):
    return LLMConfig(model_loading_config={"model_id": model_id, "model_source": path}, llm_engine="vLLM",
                     engine_kwargs=kwargs)

async def main():
    server = await LLMServer.create(config(hd32, "hd32"))
    info = server.describe()
    result["in_process"], result["pids"] = info["in_process"], info["engine_core_pids"]
    result["children"] = [p.pid for p in multiprocessing.active_children()]
    async def ask(**body):
        out = await server.handle("completions", {"model": "hd32", "prompt": PROMPT, **body})
        if not isinstance(out, dict):
            raise RuntimeError(f"{body}: {out.message}")
        return out
    greedy = await ask(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, return_token_ids=True)
    result["greedy"] = greedy["choices"][0]
    tok = AutoTokenizer.from_pretrained(hd32)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(hd32).generate(ids, max_new_tokens=8, do_sample=False)
    result["hf"] = hf[0, ids.shape[1]:].tolist()
    text = greedy["choices"][0]["text"]
    result["stop_at"] = stop = text[len(text) // 2 :][:2]
    result["stopped"] = (await ask(max_tokens=8, temperature=0, stop=[stop]))["choices"][0]
    result["n"] = (await ask(max_tokens=4, temperature=1.0, n=2, ignore_eos=True))["usage"]
    server.shutdown()
    dead = VLLMBackend(config(hd8, "hd8"))  # past the config check: vLLM's CPU attention refuses head_dim 8
    try:
        await dead.start()
        result["hd8"] = "STARTED"
    except RuntimeError as e:
        result["hd8"] = f"REFUSED {e}"
    finally:
        dead.shutdown()

asyncio.run(main())
with open(out_path, "w") as f:
    json.dump(result, f)
os._exit(0)
"""


def test_vllm_in_process_serves_and_refuses_like_its_engine_core_process(tiny_model_dir, tmp_path):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM's switch; a one-chip TPU VM's setting): tpuray's vLLM engine
    runs its engine core in the replica's process (no child process): the OpenAI fields reach vLLM and are
    honoured (greedy tokens equal transformers', logprobs, a stop string, n), it shuts down leaving the
    process able to start another, and an engine core that dies at its warm-up request in process is
    refused at start as one in a child process is (the test above). In a child process of its own: an
    in-process engine holds torch.distributed and vLLM's globals until it stops."""
    import json
    import os
    import subprocess
    import sys

    from tpuray.models import train_tiny_causal_lm

    # trained a little, so that its greedy text is text (a stop string needs some)
    hd32 = train_tiny_causal_lm(tmp_path / "hd32", steps=40, hidden_size=64, num_attention_heads=2)
    result = tmp_path / "result.json"
    out = subprocess.run(
        [sys.executable, "-c", IN_PROCESS_CHILD, str(hd32), tiny_model_dir, str(result), json.dumps(KWARGS)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert result.exists(), (out.stdout[-2000:], out.stderr[-4000:])
    got = json.loads(result.read_text())
    assert got["in_process"] is True and got["pids"] == [] and got["children"] == []
    greedy = got["greedy"]
    assert greedy["token_ids"] == got["hf"] and greedy["finish_reason"] == "length"
    lp = greedy["logprobs"]
    assert len(lp["tokens"]) == 8 and all(len(t) == 2 for t in lp["top_logprobs"])
    assert got["stopped"]["finish_reason"] == "stop"
    assert got["stopped"]["text"] == greedy["text"][: greedy["text"].index(got["stop_at"])]
    assert got["n"]["completion_tokens"] == 8
    assert got["hd8"].startswith("REFUSED") and "EngineDeadError" in got["hd8"] and "'hd8'" in got["hd8"]
    assert "the vLLM engine failed its warm-up generation" in got["hd8"]
