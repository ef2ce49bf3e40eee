"""Benchmark tpuray.serve.llm on an emulated cluster (v6e 2x2 slice + v6e 1x1 slice, CPU-backed).

1. HTTP overhead: p50/p99 latency of POST /v1/completions through Ray Serve vs calling the same
   EmbeddedBackend directly in this process (goal: overhead <= 5 ms at p50). The default one-model app is one
   deployment (proxy -> replica holding routes + engine); the two-deployment layout (proxy -> LLMRouter ->
   LLMServer, as Ray Serve LLM builds it, and as tpuray builds multi-model apps) is measured beside it,
   and so are two Serve settings that must be set before Ray starts, each on its own emulated cluster:
   the experimental direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: the replica serves HTTP on its
   own port, no proxy) and the proxy sending requests to replicas over gRPC (RAY_SERVE_PROXY_USE_GRPC=1).
2. Continuous batching: tokens/s of 16 concurrent HTTP clients vs one sequential client (goal >= 4x).
3. Tensor parallelism on the emulator: the same engine with 4 chips (2x2 slice, tpu_dist all_reduce over
   gloo) vs 1 chip (1x1 slice). The emulated chips are CPU processes sharing this machine's cores, so
   this measures the overhead of the sharded path, not TPU speed.

    .venv/bin/python benchmarks/bench_serve.py [--requests 100] [--hidden 256]
    .venv/bin/python benchmarks/bench_serve.py --only-variants default[,direct-ingress,...] --repeat 3
        (only the one-model app's HTTP rows, each run on its own cluster: for A/B runs between commits,
        e.g. with PYTHONPATH=<a git worktree of the other commit>/src)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

from _common import free_port, pct


async def http_latencies(url: str, n: int) -> list[float]:
    """Sequential 1-token completions; seconds per request after 5 warm-up requests."""
    import httpx

    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 1, "temperature": 0}
    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(n + 5):
            t = time.perf_counter()
            r = await c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            if i >= 5:  # warm-up
                out.append(time.perf_counter() - t)
    return out


async def health_latencies(url: str, n: int) -> list[float]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(n + 5):
            t = time.perf_counter()
            (await c.get(url + "/health")).raise_for_status()
            if i >= 5:
                out.append(time.perf_counter() - t)
    return out


async def post_floor_latencies(url: str, n: int) -> list[float]:
    """POST /v1/completions for an unknown model: the proxy, the body fetch and FastAPI, no engine (404)."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(n + 5):
            t = time.perf_counter()
            r = await c.post(url + "/v1/completions", json={"model": "no-such-model", "prompt": "x"})
            assert r.status_code == 404, r.text
            if i >= 5:
                out.append(time.perf_counter() - t)
    return out


async def direct_throughput(server, clients: int, per_client: int, max_tokens: int) -> float:
    from tpuray.serve.llm.openai.protocol import CompletionRequest

    async def client(k):
        toks = 0
        for j in range(per_client):
            req = CompletionRequest(
                model="tiny", prompt=f"client {k} request {j}", max_tokens=max_tokens, seed=k * 1000 + j
            )
            toks += (await server.completions(req))["usage"]["completion_tokens"]
        return toks

    t = time.perf_counter()
    toks = sum(await asyncio.gather(*(client(k) for k in range(clients))))
    return toks / (time.perf_counter() - t)


async def direct_latencies(server, n: int) -> list[float]:
    from tpuray.serve.llm.openai.protocol import CompletionRequest

    out = []
    for i in range(n + 5):
        req = CompletionRequest(model="tiny", prompt="Hello world", max_tokens=1, temperature=0)
        t = time.perf_counter()
        await server.completions(req)
        if i >= 5:
            out.append(time.perf_counter() - t)
    return out


async def http_throughput(url: str, clients: int, per_client: int, max_tokens: int) -> float:
    import httpx

    async def client(c, k):
        toks = 0
        for j in range(per_client):
            body = {
                "model": "tiny",
                "prompt": f"client {k} request {j}",
                "max_tokens": max_tokens,
                "seed": k * 1000 + j,
            }
            r = await c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            toks += r.json()["usage"]["completion_tokens"]
        return toks

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        t = time.perf_counter()
        toks = sum(await asyncio.gather(*(client(c, k) for k in range(clients))))
        return toks / (time.perf_counter() - t)


async def engine_numbers(engine, max_tokens: int, clients: int) -> tuple[float, float]:
    """(ms per token for one sequence, tokens/s with `clients` concurrent sequences)."""
    from tpuray.serve.llm.generation import SamplingParams

    async def one(prompt: str, seed: int) -> int:
        n = 0
        async for out in engine.generate(
            engine.encode_prompt(prompt), SamplingParams(max_tokens, 1.0, seed=seed)
        ):
            n = out.completion_tokens
        return n

    await one("warm up", 0)
    t = time.perf_counter()
    n = await one("single stream", 1)
    ms_per_token = (time.perf_counter() - t) * 1000 / max(n, 1)
    t = time.perf_counter()
    total = sum(await asyncio.gather(*(one(f"concurrent {i}", i) for i in range(clients))))
    return ms_per_token, total / (time.perf_counter() - t)


# Serve settings that only take effect when set before any Ray process starts: each is measured on its
# own emulated cluster, in a subprocess. name -> (environment variable, row label). "default" (no setting)
# is the main run's own proxied app, measured in a subprocess only with --only-variants (A/B runs).
VARIANTS: dict[str, tuple[str | None, str]] = {
    "default": (None, "Serve defaults (proxy -> replica over Ray actor calls)"),
    "direct-ingress": ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "Serve direct ingress (no proxy)"),
    "proxy-grpc": ("RAY_SERVE_PROXY_USE_GRPC", "Serve proxy -> replica over gRPC"),
}


def variant_child(variant: str, requests: int, direct: bool = True) -> None:
    """Run in a subprocess whose environment sets VARIANTS[variant] to 1. direct-ingress is Ray Serve's
    experimental direct ingress: each ingress replica serves HTTP on its own port (Ray's default range
    starts at 30000) and no proxy sits in the path. proxy-grpc keeps the proxy but sends requests to the
    replica over gRPC instead of Ray actor calls. Prints one JSON line."""
    import json

    import httpx
    from ray import serve

    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.models import build_tiny_causal_lm
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedCluster([SliceRequest("TPU-V6E", "1x1")], head_cpus=4, connect=True),
    ):
        tiny = str(build_tiny_causal_lm(os.path.join(tmp, "tiny")))
        cfg = dict(
            model_loading_config={"model_id": "tiny", "model_source": tiny},
            llm_engine="embedded",
            engine_kwargs={"max_model_len": 256},
        )
        proxy_port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": proxy_port})
        serve.run(
            build_openai_app(LLMServingArgs(llm_configs=[LLMConfig(**cfg)])),
            name=f"bench-{variant}",
            logging_config={"enable_access_log": False, "log_level": "WARNING"},
        )
        ports = range(30000, 30100) if variant == "direct-ingress" else [proxy_port]
        url = None
        for port in ports:  # direct ingress: the replica's port, from Ray's direct-ingress range
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    url = f"http://127.0.0.1:{port}"
                    break
            except httpx.HTTPError:
                continue
        if url is None:
            raise RuntimeError(f"{variant}: no HTTP port answered /health in {ports}")
        out = {
            "http": asyncio.run(http_latencies(url, requests)),
            "post_floor": asyncio.run(post_floor_latencies(url, requests)),
            "seq": asyncio.run(http_throughput(url, clients=1, per_client=16, max_tokens=32)),
            "conc": asyncio.run(http_throughput(url, clients=16, per_client=4, max_tokens=32)),
        }
        if direct:  # (--only-variants leaves it out: it may run against older tpuray sources)
            from tpuray.serve.llm.backends.embedded import EmbeddedBackend

            server = EmbeddedBackend(LLMConfig(**cfg))
            out["direct"] = asyncio.run(direct_latencies(server, requests))
            server.shutdown()
        serve.shutdown()
    print("VARIANT " + json.dumps(out))


def run_variant(variant: str, requests: int, direct: bool = True) -> dict[str, Any]:
    import json
    import subprocess
    import sys

    setting = VARIANTS[variant][0]
    env = dict(os.environ, **({setting: "1"} if setting else {}))
    proc = subprocess.run(
        [sys.executable, __file__, "--variant-child", variant, "--requests", str(requests)]
        + ([] if direct else ["--no-direct"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("VARIANT "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"{variant} run failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def only_variants(names: list[str], repeat: int, requests: int) -> None:
    """Each variant's HTTP rows, `repeat` times, the variants alternated; one line per run, then medians."""
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise SystemExit(f"--only-variants: {', '.join(bad)} unknown; valid: {', '.join(VARIANTS)}")
    runs: dict[str, list[dict[str, list[float]]]] = {n: [] for n in names}
    print(
        f"variant | run | p50 HTTP ms | 1 client tok/s | 16 clients tok/s  (os.cpu_count() = {os.cpu_count()})"
    )
    for i in range(repeat):
        for n in names:
            v = run_variant(n, requests, direct=False)
            runs[n].append(v)
            print(
                f"{n} | {i + 1} | {pct(v['http'], 0.5) * 1000:.1f} | {v['seq']:.0f} | {v['conc']:.0f}",
                flush=True,
            )
    for n in names:
        med = {
            k: statistics.median(r[k] if k in ("seq", "conc") else pct(r[k], 0.5) for r in runs[n])
            for k in ("http", "seq", "conc")
        }
        print(f"{n} | median | {med['http'] * 1000:.1f} | {med['seq']:.0f} | {med['conc']:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100, help="latency samples per path")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the TP comparison model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--only-variants",
        metavar="NAMES",
        help=f"only the one-model app's HTTP rows, each on its own cluster, of these comma-separated "
        f"variants ({', '.join(VARIANTS)}), run --repeat times alternated: for A/B comparisons",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per variant with --only-variants")
    ap.add_argument("--variant-child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--no-direct", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant_child:
        variant_child(args.variant_child, args.requests, direct=not args.no_direct)
        return
    if args.only_variants:
        only_variants(args.only_variants.split(","), args.repeat, args.requests)
        return

    import ray
    from ray import serve

    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.models import build_tiny_causal_lm
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app
    from tpuray.serve.llm.backends.embedded import EmbeddedBackend
    from tpuray.serve.llm.engine.embedded.engine import EmbeddedEngine

    rows: list[tuple[str, str, str, str]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedCluster(
            [SliceRequest("TPU-V6E", "2x2"), SliceRequest("TPU-V6E", "1x1")], head_cpus=4
        ) as cluster,
    ):
        cluster.connect()
        tiny = str(build_tiny_causal_lm(os.path.join(tmp, "tiny")))
        cpu_cfg = dict(
            model_loading_config={"model_id": "tiny", "model_source": tiny},
            llm_engine="embedded",
            engine_kwargs={"max_model_len": 256},
        )

        # 1 + 2: HTTP vs direct, batching -------------------------------------------------------------
        port = free_port()
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": "127.0.0.1", "port": port},
            logging_config={"enable_access_log": False},
        )
        try:
            quiet = {"enable_access_log": False, "log_level": "WARNING"}
            serve.run(
                build_openai_app(LLMServingArgs(llm_configs=[LLMConfig(**cpu_cfg)])),
                name="bench",
                logging_config=quiet,
            )
            serve.run(
                build_openai_app(LLMServingArgs(llm_configs=[LLMConfig(**cpu_cfg)], single_deployment=False)),
                name="bench-router",
                route_prefix="/router",
                logging_config=quiet,
            )
            url = f"http://127.0.0.1:{port}"
            floor = asyncio.run(health_latencies(url, args.requests))
            post_floor = asyncio.run(post_floor_latencies(url, args.requests))
            http = asyncio.run(http_latencies(url, args.requests))
            http_router = asyncio.run(http_latencies(url + "/router", args.requests))
            serve.delete("bench-router")
            direct_server = EmbeddedBackend(LLMConfig(**cpu_cfg))
            direct = asyncio.run(direct_latencies(direct_server, args.requests))
            eng_seq = asyncio.run(direct_throughput(direct_server, clients=1, per_client=16, max_tokens=32))
            eng_conc = asyncio.run(direct_throughput(direct_server, clients=16, per_client=4, max_tokens=32))
            direct_server.shutdown()
            over50 = (pct(http, 0.5) - pct(direct, 0.5)) * 1000
            over99 = (pct(http, 0.99) - pct(direct, 0.99)) * 1000
            rows.append(
                (
                    "p50 latency, 1 token",
                    f"direct {pct(direct, 0.5) * 1000:.1f} ms",
                    f"HTTP {pct(http, 0.5) * 1000:.1f} ms",
                    f"overhead {over50:+.1f} ms (goal <= 5)",
                )
            )
            rows.append(
                (
                    "  same, LLMRouter -> LLMServer (2 hops)",
                    f"direct {pct(direct, 0.5) * 1000:.1f} ms",
                    f"HTTP {pct(http_router, 0.5) * 1000:.1f} ms",
                    f"overhead {(pct(http_router, 0.5) - pct(direct, 0.5)) * 1000:+.1f} ms",
                )
            )
            rows.append(
                (
                    "Serve floor: GET /health p50",
                    "-",
                    f"HTTP {pct(floor, 0.5) * 1000:.1f} ms",
                    "proxy + replica, no model",
                )
            )
            rows.append(
                (
                    "Serve floor: POST, unknown model p50",
                    "-",
                    f"HTTP {pct(post_floor, 0.5) * 1000:.1f} ms",
                    "+ request body fetched from the proxy",
                )
            )
            rows.append(
                (
                    "p99 latency, 1 token",
                    f"direct {pct(direct, 0.99) * 1000:.1f} ms",
                    f"HTTP {pct(http, 0.99) * 1000:.1f} ms",
                    f"overhead {over99:+.1f} ms",
                )
            )
            seq = asyncio.run(http_throughput(url, clients=1, per_client=16, max_tokens=32))
            conc = asyncio.run(http_throughput(url, clients=16, per_client=4, max_tokens=32))
            rows.append(
                (
                    "HTTP tokens/s, 32-token completions",
                    f"1 client {seq:.0f}",
                    f"16 clients {conc:.0f}",
                    f"{conc / seq:.1f}x (goal >= 4x)",
                )
            )
            rows.append(
                (
                    "engine tokens/s (no HTTP), same load",
                    f"1 client {eng_seq:.0f}",
                    f"16 clients {eng_conc:.0f}",
                    f"{eng_conc / eng_seq:.1f}x",
                )
            )
        finally:
            serve.shutdown()

        # 3: tensor parallel 4 chips vs 1 chip, same engine path (worker actors on emulated tpu) ---------
        med = str(
            build_tiny_causal_lm(
                os.path.join(tmp, "medium"),
                hidden_size=args.hidden,
                intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers,
            )
        )
        results = {}
        for topo, tp in (("1x1", 1), ("2x2", 4)):
            cfg = LLMConfig(
                model_loading_config={"model_id": "medium", "model_source": med},
                llm_engine="embedded",
                accelerator_type="TPU-V6E",
                accelerator_config={"kind": "tpu", "topology": topo},
                engine_kwargs={"tensor_parallel_size": tp, "max_model_len": 256},
            )
            engine = EmbeddedEngine(cfg)
            try:
                results[tp] = asyncio.run(engine_numbers(engine, max_tokens=32, clients=16))
            finally:
                engine.shutdown()
        (ms1, tps1), (ms4, tps4) = results[1], results[4]
        rows.append(
            (
                f"TP ms/token (hidden {args.hidden}, {args.layers} layers)",
                f"1 chip {ms1:.1f}",
                f"4 chips {ms4:.1f}",
                f"{ms1 / ms4:.2f}x speed-up",
            )
        )
        rows.append(
            ("TP tokens/s, 16 concurrent", f"1 chip {tps1:.0f}", f"4 chips {tps4:.0f}", f"{tps4 / tps1:.2f}x")
        )
        ray.shutdown()

    # 4: the same one-model app with Serve settings that need their own cluster ---------------------------
    for offset, variant in enumerate(v for v in VARIANTS if v != "default"):
        v, label = run_variant(variant, args.requests), VARIANTS[variant][1]
        rows.insert(
            2 + offset,
            (
                f"  same, {label}",
                f"direct {pct(v['direct'], 0.5) * 1000:.1f} ms",
                f"HTTP {pct(v['http'], 0.5) * 1000:.1f} ms",
                f"overhead {(pct(v['http'], 0.5) - pct(v['direct'], 0.5)) * 1000:+.1f} ms "
                f"(POST floor {pct(v['post_floor'], 0.5) * 1000:.1f} ms)",
            ),
        )
        rows.insert(
            next(i for i, r in enumerate(rows) if r[0].startswith("engine tokens/s")),
            (
                f"  same, {label}",
                f"1 client {v['seq']:.0f}",
                f"16 clients {v['conc']:.0f}",
                f"{v['conc'] / v['seq']:.1f}x",
            ),
        )

    print(f"\ntpuray.serve.llm benchmark (emulated TPU on CPU; os.cpu_count() = {os.cpu_count()})")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  " + "  |  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(
        f"  latency samples: {args.requests} per path (median of HTTP {statistics.median(http) * 1000:.1f} ms)"
    )


if __name__ == "__main__":
    main()
