"""vLLM-TorchTPU on the real chip behind tpuray's serving backend, in this process: the same
`LLMConfig(llm_engine="vLLM")` and `LLMServer` a Serve replica runs, with vLLM's engine core in the
replica's process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process holds the chip, and the VM has no TCP for
an engine-core process). A small model trained here (confident greedy choices): its greedy tokens from
vLLM on the chip equal the embedded engine's on the chip and the CPU's; OpenAI fields pass through
tpuray's backend to vLLM and are honoured (a seed, which vLLM-TorchTPU refuses, is a 400 naming it); a
model vLLM-TorchTPU cannot serve as configured (float32: it computes in bfloat16 only) is refused at start
under llm_engine "vLLM", and "auto" serves it with the embedded engine (which "auto" picks on a TPU
anyway: support.auto_prefers_embedded)."""

from __future__ import annotations

import asyncio
import os

import pytest

from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (vLLM-TorchTPU) is not installed")

ENGINE_KWARGS = {"max_model_len": 256, "max_num_seqs": 4, "dtype": "bfloat16", "gpu_memory_utilization": 0.3}
PROMPT = "Ray schedules tasks and actors"  # the corpus's first words: the continuation is learned text


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: vLLM's output handler lives on the loop of the first request."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tpuray.models import train_tiny_causal_lm

    return str(train_tiny_causal_lm(tmp_path_factory.mktemp("vllm") / "model", steps=300))


def _config(path: str, engine: str = "vLLM", **kwargs):
    from tpuray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": path},
        llm_engine=engine,
        engine_kwargs={**ENGINE_KWARGS, **kwargs},
    )


@pytest.fixture(scope="module")
def server(tpu, trained, loop):
    from tpuray.serve.llm.deployments.server import LLMServer

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # tpu-vm/env.sh sets it; a bare run too
    server = loop.run_until_complete(LLMServer.create(_config(trained)))
    yield server
    server.shutdown()


def _complete(server, loop, **body):
    out = loop.run_until_complete(server.handle("completions", {"model": "tiny", **body}))
    assert isinstance(out, dict), getattr(out, "message", out)
    return out


def test_vllm_torchtpu_serves_on_the_chip_in_this_process(server):
    info = server.describe()
    print("describe:", {k: info[k] for k in ("vllm_version", "platform", "where", "in_process")})
    assert info["engine"] == "vLLM" and info["platform"] == "TpuPlatform"
    assert info["in_process"] and info["engine_core_pids"] == []


def test_greedy_tokens_equal_the_embedded_engine_on_the_chip(
    server, loop, trained, embedded_greedy, highest_precision
):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(trained)(PROMPT)["input_ids"]
    got = _complete(
        server, loop, prompt=prompt, max_tokens=64, temperature=0, ignore_eos=True, return_token_ids=True
    )["choices"][0]["token_ids"]
    on_chip = embedded_greedy(trained, prompt, 64, device="tpu", dtype="bfloat16")
    on_cpu = embedded_greedy(trained, prompt, 64, dtype="float32")
    print(f"vLLM {got}\nembedded on the chip {on_chip}\nCPU {on_cpu}")
    assert got == on_chip == on_cpu


def test_openai_fields_are_honoured(server, loop):
    greedy = _complete(server, loop, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    choice = greedy["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 24 and choice["finish_reason"] == "length"
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) == 2 for t in lp["top_logprobs"])
    # greedy: each chosen token is the most likely of its top two
    assert all(
        abs(max(t.values()) - v) < 1e-3 for t, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True)
    )
    text = choice["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = _complete(server, loop, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == text[: text.index(stop)], (stop, stopped)
    short = _complete(server, loop, prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True)
    assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["finish_reason"] == "length"
    many = _complete(server, loop, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, ignore_eos=True)
    assert sorted(c["index"] for c in many["choices"]) == [0, 1, 2]
    assert many["usage"]["completion_tokens"] == 24
    seeded = loop.run_until_complete(
        server.handle("completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "seed": 1})
    )
    print("a seeded request:", getattr(seeded, "status", None), getattr(seeded, "message", seeded))
    # vLLM-TorchTPU refuses it ("JAX does not support per-request seed."): a 400 naming the field
    assert getattr(seeded, "status", None) == 400 and seeded.param == "seed"


def test_float32_is_refused_by_vllm_and_served_by_the_embedded_engine_under_auto(tpu, trained, loop, server):
    from tpuray.serve.llm.backends.factory import create_backend
    from tpuray.serve.llm.deployments.server import LLMServer
    from tpuray.validation import ConfigError

    with pytest.raises(ConfigError, match=r"computes in bfloat16.*dtype='float32'") as refused:
        create_backend(_config(trained, dtype="float32"))
    print("refused:", refused.value)
    auto_config = _config(trained, engine="auto", dtype="float32")
    del auto_config.engine_kwargs["gpu_memory_utilization"]  # vLLM's key, which the embedded engine ignores
    auto = loop.run_until_complete(LLMServer.create(auto_config))
    try:
        assert auto.describe()["engine"] == "embedded"
        out = loop.run_until_complete(
            auto.handle("completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        )
        assert isinstance(out, dict) and out["usage"]["completion_tokens"] == 4, out
    finally:
        auto.shutdown()
