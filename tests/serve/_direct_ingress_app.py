"""Run by test_direct_ingress.py in a fresh process with RAY_SERVE_ENABLE_DIRECT_INGRESS=1: a one-model
tpuray app behind Ray Serve's direct ingress (the replica serves HTTP on its own port, no proxy), driven
with the openai client. Prints OK and exits 0 when every check passes."""

from __future__ import annotations

import os
import sys
import tempfile

import httpx
import openai
from ray import serve

from tpuray.emulator import EmulatedCluster, SliceRequest
from tpuray.models import build_tiny_causal_lm
from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app


def replica_url() -> str:
    for port in range(30000, 30100):  # Ray's default direct-ingress port range starts at 30000
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            continue
    raise RuntimeError("no direct-ingress replica answered on ports 30000-30099")


def main(port: int) -> None:
    assert os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedCluster([SliceRequest("TPU-V6E", "1x1")], head_cpus=2, connect=True),
    ):
        config = LLMConfig(
            model_loading_config={"model_id": "tiny", "model_source": str(build_tiny_causal_lm(tmp + "/m"))},
            engine_kwargs={"max_model_len": 128},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(LLMServingArgs(llm_configs=[config])), name="direct")
        try:
            c = openai.OpenAI(base_url=replica_url() + "/v1", api_key="unused", max_retries=0, timeout=60)
            kw = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
            text = c.completions.create(**kw).choices[0].text
            streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True))
            assert text and streamed == text, (text, streamed)
            try:
                c.completions.create(model="nope", prompt="x", max_tokens=1)
                raise AssertionError("unknown model was accepted")
            except openai.NotFoundError:
                pass
        finally:
            serve.shutdown()
    print("OK")


if __name__ == "__main__":
    main(int(sys.argv[1]))
