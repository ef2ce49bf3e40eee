"""Recovery of a served model whose engine dies under load: an engine process killed, or a host lost.

    .venv/bin/python benchmarks/bench_serve_recovery.py                        # the whole matrix (1-2 h)
    .venv/bin/python benchmarks/bench_serve_recovery.py --engine vLLM --tp 4 --load 0
    .venv/bin/python benchmarks/bench_serve_recovery.py --kill host --tp 4 --load 0

One emulated cluster (CPU head + two v6e 2x2 slices), one Serve instance; per case a fresh one-model app
(the tiny model, replica on the head, Serve's default health check) under 8 closed-loop clients (half of
them streamed, 8 tokens each), and from the kill on a probe besides: a new request every PROBE_S, one at
a time. A case is an engine, a tensor_parallel_size, a CPU load and what is killed:
- embedded, TP 1 / 2 / 4: 1 / 2 / 4 engine workers on a 2x2 slice; `process` SIGKILLs the last worker
  (at TP > 1 a rank whose peers live on);
- vLLM, TP 4: its Ray executor's 4 workers on a 2x2 slice; TP 1: on the head's CPU, no slice (a
  one-chip v6e slice is a host type this cluster has not); `process` SIGKILLs vLLM's engine core. No
  vLLM TP 2: a vLLM engine takes all of its slice's chips (no TPU slice has 2), and tensor 2 x pipeline
  2 on a 2x2 fails in vLLM 0.29's CPU backend (an assertion on its pipeline's intermediate tensors);
- `host` kills the emulated host of the engine's slice (raylet and all its processes) instead;
- load N: N busy Python processes (`while True: pass`) from before the kill to the case's end.
Reported per case, in seconds from the kill, as the clients saw it: the first 503 (engine_dead, with
Retry-After) of a request in flight at the kill, the last answer to one; the first and the last 503 of a
request sent after the kill (the window in which the replica answers 503s while it starts a new engine),
the longest a 503 of one took; the first 200 of one (the new engine serving); the longest any request
sent after the kill waited, whatever it got; whether the same replica served after the kill (Serve did
not replace it); and the requests that failed, by what the client saw (a 503 response without
Retry-After counts apart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(__file__))
from _common import free_port  # noqa: E402

CLIENTS, TOKENS = 8, 8
STEADY_S = 8.0  # load before the kill
PROBE_S = 0.5  # a new request this often from the kill on
CAP_S = 900.0  # a case ends at the first 200 after the kill (plus 2 s), or this long after the kill
ENGINES, TPS, LOADS = ("embedded", "vLLM"), (1, 2, 4), (0, 2)


@dataclass(frozen=True)
class Case:
    engine: str
    tp: int
    load: int  # busy processes beside the cluster
    kill: str  # "process" | "host"

    @property
    def name(self) -> str:
        what = "engine core" if self.engine == "vLLM" else "worker"
        return f"{self.engine} TP={self.tp} {what if self.kill == 'process' else 'host'}, load {self.load}"


@dataclass
class Request:
    sent: float
    end: float = math.nan
    outcome: str = "no answer"


def config(case: Case, model_dir: str):
    from tpuray.constants import ROLE_LABEL
    from tpuray.serve.llm import LLMConfig, ModelLoadingConfig

    kwargs: dict = {"tensor_parallel_size": case.tp, "max_model_len": 256, "dtype": "float32"}
    slice_config: dict = {
        "accelerator_type": "TPU-V6E",
        "accelerator_config": {"kind": "tpu", "topology": "2x2"},
    }
    if case.engine == "vLLM":
        kwargs["enforce_eager"] = True
        if case.tp == 1:
            slice_config = {}
    else:
        slice_config["placement_group_config"] = {"bundle_per_worker": {"TPU": 4 // case.tp}}
    return LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id="tiny", model_source=model_dir),
        llm_engine=case.engine,
        engine_kwargs=kwargs,
        deployment_config={"ray_actor_options": {"label_selector": {ROLE_LABEL: "head"}}},
        **slice_config,
    )


def refused(r) -> str:
    """An error response: "503" (engine_dead with a Retry-After), or what else it was."""
    code = (r.json().get("error") or {}).get("code") if r.status_code == 503 else None
    if code == "engine_dead":
        return "503" if r.headers.get("retry-after", "").isdigit() else "503 without Retry-After"
    return f"{r.status_code} {r.text[:120]}"


async def request(http, url: str, tag: str, n: int, stream: bool) -> str:
    """One completion: "200", "503" (engine_dead, with Retry-After) or what else the client saw."""
    body = {"model": "tiny", "prompt": f"{tag} request {n}", "max_tokens": TOKENS, "seed": n}
    if not stream:
        r = await http.post(url, json=body)
        return "200" if r.status_code == 200 else refused(r)
    async with http.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return refused(r)
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if '"error"' in e]
    if errors:
        return "503" if errors[0].get("code") == "engine_dead" else f"stream error {errors[0]}"
    return "200" if events and events[-1] == "[DONE]" else "incomplete stream"


async def timed(http, url: str, tag: str, n: int, stream: bool, done: list[Request]) -> Request:
    import httpx

    rec = Request(time.time())
    done.append(rec)
    try:
        rec.outcome = await request(http, url, tag, n, stream)
    except httpx.HTTPError as e:  # e.g. the proxy restarting: counted
        rec.outcome = f"client error {type(e).__name__}"
    rec.end = time.time()
    return rec


def kill_action(cluster, handle, case: Case):
    """The kill of one case: a callable returning the host to restore after it (or None)."""
    info = handle.describe.remote().result()
    if case.kill == "host":
        node = info["workers"][-1]["node_id"] if case.engine == "embedded" else info["bundle_nodes"][0]
        return lambda: cluster.kill_host(node)
    pid = info["workers"][-1]["pid"] if case.engine == "embedded" else info["engine_core_pids"][0]
    return lambda: os.kill(pid, signal.SIGKILL)


async def load_and_kill(url: str, kill, done: list[Request], marks: dict) -> None:
    """8 closed-loop clients; after STEADY_S the kill, then a probe every PROBE_S, until the first 200 of
    a request sent after the kill (plus 2 s) or CAP_S."""
    import httpx

    stop = asyncio.Event()

    async def client(i: int, http) -> None:
        n = 0
        while not stop.is_set():
            rec = await timed(http, url, f"client {i}", n, i % 2 == 1, done)
            n += 1
            if rec.outcome != "200":
                await asyncio.sleep(0.5)  # back off, as an OpenAI client does

    async with httpx.AsyncClient(timeout=CAP_S + 60) as http:
        tasks = [asyncio.create_task(client(i, http)) for i in range(CLIENTS)]
        await asyncio.sleep(STEADY_S)
        marks["kill"] = time.time()
        marks["token"] = await asyncio.to_thread(kill)
        n, probe = 0, None
        while time.time() < marks["kill"] + CAP_S:
            if probe is None or probe.done():  # one at a time: none piles up in Serve's proxy
                probe = asyncio.create_task(timed(http, url, "probe", n, n % 2 == 1, done))
                tasks.append(probe)
                n += 1
            await asyncio.sleep(PROBE_S)
            if any(r.sent >= marks["kill"] and r.outcome == "200" for r in done):
                await asyncio.sleep(2)
                break
        stop.set()  # the requests under way may end (the replacement serves them), for up to 30 s
        served = any(r.sent >= marks["kill"] and r.outcome == "200" for r in done)
        await asyncio.wait(tasks, timeout=30 if served else 0)
        marks["stop"] = time.time()
        for t in tasks:  # the requests still waiting stay "no answer"
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def figures(case: Case, done: list[Request], kill: float, stop: float, replica_kept: bool) -> dict:
    """The case's row: seconds from the kill (nan: none), and the failures by what the client saw."""

    def first(rows: list[Request], outcome: str) -> float:
        return min((r.end for r in rows if r.outcome == outcome), default=math.nan) - kill

    def last(rows: list[Request], outcome: str) -> float:
        return max((r.end for r in rows if r.outcome == outcome), default=math.nan) - kill

    def ended(r: Request) -> float:  # a request still waiting at the case's end counts to then
        return stop if math.isnan(r.end) else r.end

    inflight = [r for r in done if r.sent < kill <= ended(r)]
    new = [r for r in done if r.sent >= kill]
    return {
        "case": case.name,
        "requests": len(done),
        "inflight_503_s": first(inflight, "503"),
        "inflight_last_s": max((ended(r) for r in inflight), default=kill) - kill,
        "new_503_s": first(new, "503"),
        "new_503_last_s": last(new, "503"),
        "new_503_max_s": max((r.end - r.sent for r in new if r.outcome == "503"), default=math.nan),
        "back_200_s": first(new, "200"),
        "new_wait_max_s": max((ended(r) - r.sent for r in new), default=math.nan),
        "replica_kept": replica_kept,
        "failed": dict(Counter(r.outcome for r in done if r.outcome != "200")),
    }


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_case(cluster, port: int, case: Case, model_dir: str) -> dict:
    from ray import serve

    from tpuray.serve.llm import LLMServingArgs, build_openai_app

    app = build_openai_app(LLMServingArgs(llm_configs=[config(case, model_dir)]))
    serve.run(app, name="rec", route_prefix="/")
    handle = serve.get_deployment_handle("LLMServer:tiny", app_name="rec")
    replica = handle.describe.remote().result()["replica_pid"]
    kill = kill_action(cluster, handle, case)
    done: list[Request] = []
    marks: dict = {}
    busy = burners(case.load)
    try:
        asyncio.run(load_and_kill(f"http://127.0.0.1:{port}/v1/completions", kill, done, marks))
        kept = handle.describe.remote().result(timeout_s=60)["replica_pid"] == replica
    finally:
        for p in busy:
            p.kill()
            p.wait()
        serve.delete("rec")
        if case.kill == "host" and marks.get("token"):
            cluster.restore_host(marks["token"])
    return {**figures(case, done, marks["kill"], marks["stop"], kept), "loadavg_1m": os.getloadavg()[0]}


def table(rows: list[dict]) -> str:
    cols = [
        ("in flight: 1st 503", "inflight_503_s"),
        ("last answer", "inflight_last_s"),
        ("new: 1st 503", "new_503_s"),
        ("last 503", "new_503_last_s"),
        ("slowest 503", "new_503_max_s"),
        ("1st 200", "back_200_s"),
        ("longest wait", "new_wait_max_s"),
    ]
    lines = [f"{'case':<34}{'requests':>9}" + "".join(f"{h:>20}" for h, _ in cols) + "  same replica  failed"]
    for r in rows:
        cells = "".join(f"{r[k]:>20.1f}" for _, k in cols)
        kept = "yes" if r["replica_kept"] else "no"
        lines.append(
            f"{r['case']:<34}{r['requests']:>9}{cells}  {kept:>12}  {r['failed']} (load avg {r['loadavg_1m']:.0f})"
        )
    return "\n".join(lines)


def cases(args: argparse.Namespace) -> list[Case]:
    return [
        Case(engine, tp, load, args.kill)
        for load in args.load or LOADS
        for engine in args.engine or ENGINES
        for tp in args.tp or TPS
        if not (engine == "vLLM" and (tp == 2 or (tp == 1 and args.kill == "host")))  # see the docstring
    ]


def main() -> int:
    from ray import serve

    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.models import build_tiny_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, action="append", help="default: both")
    parser.add_argument("--tp", type=int, choices=TPS, action="append", help="default: 1, 2 and 4")
    parser.add_argument("--load", type=int, action="append", help="busy processes; default: 0 and 2")
    parser.add_argument("--kill", choices=("process", "host"), default="process")
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
        for case in cases(args):
            try:
                rows.append(run_case(cluster, port, case, model))
            except Exception as e:  # noqa: BLE001 - e.g. an engine that cannot start this case: said, next
                print(f"{case.name}: did not run: {type(e).__name__}: {str(e)[:300]}", flush=True)
                serve.delete("rec")
                continue
            print(json.dumps(rows[-1]), flush=True)
        serve.shutdown()
    print(f"\n{CLIENTS} clients + a probe every {PROBE_S}s after the kill; seconds from the kill")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
