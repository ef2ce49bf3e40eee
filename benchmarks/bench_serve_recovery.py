"""Recovery of a served model whose engine dies under load: an engine process killed, or a host lost.

    .venv/bin/python benchmarks/bench_serve_recovery.py                  # both engines (~10 min)
    .venv/bin/python benchmarks/bench_serve_recovery.py --engine embedded

One emulated cluster (CPU head + two v6e 2x2 slices), one Serve instance; per case one app (the tiny
model, TP=4 over a 2x2 slice, replica on the head) under 8 closed-loop clients (half of them streamed, 8
tokens each). Cases, each on a fresh app:
- embedded / worker: an embedded engine worker's process is SIGKILLed;
- vLLM / engine core: vLLM's engine core process (a child of the replica) is SIGKILLed;
- <engine> / host: the emulated host of the engine's slice is killed (raylet and all its processes).
Reported per case: requests that failed, by what the client saw (503 engine_dead: a 503 response or, for a
started stream, an error event; anything else is listed too), seconds from the kill to the first 200 of a
request sent after it (the replacement replica serving), and p99 latency of the requests sent between the
kill and that 200, side by side with the p99 before the kill (their ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))
from _common import free_port, pct  # noqa: E402

CLIENTS, TOKENS = 8, 8
STEADY_S = 8.0  # load before the kill
CASES = {"embedded": ("worker", "host"), "vLLM": ("engine core", "host")}


def config(engine: str, model_dir: str):
    from tpuray.constants import ROLE_LABEL
    from tpuray.serve.llm import LLMConfig, ModelLoadingConfig

    kwargs = {"tensor_parallel_size": 4, "max_model_len": 256, "dtype": "float32"}
    if engine == "vLLM":
        kwargs["enforce_eager"] = True
    return LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id="tiny", model_source=model_dir),
        llm_engine=engine,
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
        engine_kwargs=kwargs,
        deployment_config={"ray_actor_options": {"label_selector": {ROLE_LABEL: "head"}}},
    )


async def request(http, url: str, i: int, n: int) -> str:
    """One completion (odd clients stream): "200", "503" (engine_dead) or what else the client saw."""
    body = {"model": "tiny", "prompt": f"client {i} request {n}", "max_tokens": TOKENS, "seed": n}
    if i % 2 == 0:
        r = await http.post(url, json=body)
        return str(r.status_code) if r.status_code in (200, 503) else f"{r.status_code} {r.text[:120]}"
    async with http.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return str(r.status_code)
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if '"error"' in e]
    if errors:
        return "503" if errors[0].get("code") == "engine_dead" else f"stream error {errors[0]}"
    return "200" if events and events[-1] == "[DONE]" else "incomplete stream"


def kill_action(cluster, handle, engine: str, what: str):
    """The kill of one case, and the host to restore after it (None)."""
    info = handle.describe.remote().result()
    if what == "host":
        node = (info["workers"][0]["node_id"]) if engine == "embedded" else info["bundle_nodes"][0]
        return lambda: cluster.kill_host(node)
    pid = info["workers"][1]["pid"] if engine == "embedded" else info["engine_core_pids"][0]
    return lambda: os.kill(pid, signal.SIGKILL)


def run_case(cluster, port: int, engine: str, what: str, model_dir: str) -> dict:
    import httpx
    from ray import serve

    from tpuray.serve.llm import LLMServingArgs, build_openai_app

    serve.run(
        build_openai_app(LLMServingArgs(llm_configs=[config(engine, model_dir)])),
        name="rec",
        route_prefix="/",
    )
    handle = serve.get_deployment_handle("LLMServer:tiny", app_name="rec")
    kill = kill_action(cluster, handle, engine, what)
    url = f"http://127.0.0.1:{port}/v1/completions"
    done: list[tuple[float, float, str]] = []  # (sent, latency, outcome)
    marks: dict = {}

    async def client(i: int, http, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            t0 = time.time()
            try:
                outcome = await request(http, url, i, n)
            except httpx.HTTPError as e:  # e.g. the proxy restarting: counted, retried after a pause
                outcome = f"client error {type(e).__name__}"
                await asyncio.sleep(0.5)
            done.append((t0, time.time() - t0, outcome))
            n += 1

    async def run() -> None:
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=300) as http:
            tasks = [asyncio.create_task(client(i, http, stop)) for i in range(CLIENTS)]
            await asyncio.sleep(STEADY_S)
            marks["kill"] = time.time()
            marks["token"] = await asyncio.to_thread(kill)
            while not any(s >= marks["kill"] and o == "200" for s, _, o in done):
                await asyncio.sleep(0.05)
            marks["back"] = min(s + lat for s, lat, o in done if s >= marks["kill"] and o == "200")
            await asyncio.sleep(2)
            stop.set()
            await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
    finally:
        serve.delete("rec")
        if what == "host" and marks.get("token"):
            cluster.restore_host(marks["token"])
    steady = [lat for s, lat, _ in done if s < marks["kill"]]
    during = [lat for s, lat, _ in done if marks["kill"] <= s <= marks["back"]]
    failed = Counter(o for _, _, o in done if o != "200")
    return {
        "case": f"{engine} / {what}",
        "requests": len(done),
        "failed": dict(failed),
        "recovery_s": marks["back"] - marks["kill"],
        "p99_steady_ms": 1000 * pct(steady, 0.99),
        "p99_during_ms": 1000 * pct(during, 0.99) if during else float("nan"),
    }


def main() -> int:
    from ray import serve

    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.models import build_tiny_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(CASES), action="append", help="default: both")
    args = parser.parse_args()
    os.environ.setdefault("TPURAY_QUIET", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=2)], head_cpus=4, connect=True) as cluster,
    ):
        print(f"cores: {os.cpu_count()}; {cluster.describe()}")
        # head_dim 64 (hidden 256, 4 heads): what vLLM's CPU attention takes; the same weights for both
        model = str(
            build_tiny_causal_lm(
                os.path.join(tmp, "model"),
                hidden_size=256,
                num_attention_heads=4,
                max_position_embeddings=512,
            )
        )
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        for engine in args.engine or sorted(CASES):
            for what in CASES[engine]:
                rows.append(run_case(cluster, port, engine, what, model))
                print(json.dumps(rows[-1]), flush=True)
        serve.shutdown()
    print(f"\n{CLIENTS} clients, TP=4 on an emulated v6e 2x2 slice; latency of {TOKENS}-token completions")
    print(
        f"{'case':<22}{'requests':>9}{'kill -> 200 (s)':>17}{'p99 before (ms)':>17}{'p99 during (ms)':>17}"
        f"{'ratio':>7}  failed"
    )
    for r in rows:
        ratio = r["p99_during_ms"] / r["p99_steady_ms"]
        print(
            f"{r['case']:<22}{r['requests']:>9}{r['recovery_s']:>17.1f}{r['p99_steady_ms']:>17.0f}"
            f"{r['p99_during_ms']:>17.0f}{ratio:>7.1f}  {r['failed']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
