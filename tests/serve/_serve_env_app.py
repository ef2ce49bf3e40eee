"""Run by test_serve_env_settings.py in a fresh process whose environment sets two Ray Serve settings to 1:
RAY_SERVE_ENABLE_DIRECT_INGRESS (each ingress replica serves HTTP on its own port) and
RAY_SERVE_PROXY_USE_GRPC (the proxy, which still runs, sends requests to replicas over gRPC). A one-model
tpuray app (the tiny model in the directory given) is driven with the openai client through both doors:
the replica's own port and the proxy's. Prints OK and exits 0 when every check passes."""

from __future__ import annotations

import os
import sys

import httpx
import openai
from ray import serve

from tpuray.emulator import EmulatedCluster, SliceRequest
from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

SETTINGS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_PROXY_USE_GRPC")


def answering(ports: range | list[int]) -> str:
    """The first of `ports` on 127.0.0.1 that answers /health with 200."""
    for port in ports:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            continue
    raise RuntimeError(f"no replica or proxy answered /health on {ports}")


def check(url: str) -> None:
    """Completion, stream, chat stream and an unknown model through `url`."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    text = c.completions.create(**kw).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True))
    assert text and streamed == text, (url, text, streamed)
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices), (
        f"{url}: empty chat stream"
    )
    try:
        c.completions.create(model="nope", prompt="x", max_tokens=1)
        raise AssertionError(f"{url}: unknown model was accepted")
    except openai.NotFoundError:
        pass


def main(port: int, model_dir: str) -> None:
    for setting in SETTINGS:
        assert os.environ.get(setting) == "1", setting
    with EmulatedCluster([SliceRequest("TPU-V6E", "1x1")], head_cpus=2, connect=True):
        config = LLMConfig(
            model_loading_config={"model_id": "tiny", "model_source": model_dir},
            llm_engine="embedded",
            engine_kwargs={"max_model_len": 128},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(LLMServingArgs(llm_configs=[config])), name="env-setting")
        try:
            direct = answering(range(30000, 30100))  # direct ingress: Ray's replica ports start at 30000
            check(direct)
            print(f"direct ingress OK: {direct}", flush=True)  # one write: Ray's log lines go between writes
            proxy = answering([port])  # the proxy, talking to the replica over gRPC
            check(proxy)
            print(f"proxy over gRPC OK: {proxy}", flush=True)
        finally:
            serve.shutdown()
    print("OK")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
