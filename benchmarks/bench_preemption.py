"""Spot preemption on emulated slices: training and serving, with the notice vs a hard host kill.

    .venv/bin/python benchmarks/bench_preemption.py               # training and serving (~4 min)
    .venv/bin/python benchmarks/bench_preemption.py --train-only  # the training cases alone

One emulated cluster (CPU head + two v6e 2x2 slices: one to lose, one spare), Ray's real drain API.
Training (4 workers, one all_reduce'd step every 0.2 s, reported each step): the slice is preempted with
a 10 s notice (the loop checkpoints when asked), side by side with a hard kill of the host (no notice;
the loop checkpoints every 5 steps). Reported: steps lost (steps reported before the event that the
resumed run had to redo), seconds from the event to the first step on the spare slice, and (notice)
seconds from the drain call to the moment the training loop sees the notice (`get_preemption_info()`
set, `should_checkpoint()` true: the loop checks every 10 ms during its steps).
Serving (the embedded engine, TP=4 on a 2x2 slice, replica on the head, 16 closed-loop clients): the
engine's slice is preempted with a 10 s notice mid-run. Reported: failed requests and latency, overall
and for the requests sent between the notice and the first response from the replacement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import free_port, pct  # noqa: E402

STEPS, STEP_S, EVENT_AT = 30, 0.2, 7  # the event lands between two periodic checkpoints (every 5)


def loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import tpuray.train.torch as tt
    from tpuray import train
    from tpuray.train import Checkpoint

    start = 0
    restored = train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            start = torch.load(os.path.join(d, "state.pt"))["step"]
    ctx = train.get_context()
    notice_seen = None  # when this loop first saw the preemption notice (UNIX s)
    for step in range(start, STEPS):
        x = torch.ones(2, device=tt.get_device())
        dist.all_reduce(x)
        done = time.time() + STEP_S
        while (left := done - time.time()) > 0:  # the step's compute, watching for the notice meanwhile
            if notice_seen is None and train.get_preemption_info() is not None and ctx.should_checkpoint():
                notice_seen = time.time()
            time.sleep(min(0.01, left))
        if notice_seen is None and train.get_preemption_info() is not None:  # it came during report()
            notice_seen = time.time()
        metrics = {
            "step": step + 1,
            "attempt": ctx.get_attempt(),
            "resumed_from": start,
            "t": time.time(),
            "notice_seen_t": notice_seen,
        }
        asked = ctx.should_checkpoint() and ctx.get_world_rank() == 0
        if asked or (step + 1) % config["ckpt_every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"step": step + 1}, os.path.join(d, "state.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
        if ctx.get_world_rank() == 0:  # every step as it happened (metrics_history keeps each once)
            with open(config["log"], "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if ctx.get_attempt() == 0 and step + 1 == EVENT_AT and ctx.get_world_rank() == 0:
            open(config["marker"], "w").write(__import__("ray").get_runtime_context().get_node_id())


def train_case(cluster, how: str, storage: str) -> dict:
    from tpuray.train import FailureConfig, RunConfig, ScalingConfig
    from tpuray.train.torch import TorchTrainer

    marker = os.path.join(storage, f"{how}.marker")
    log = os.path.join(storage, f"{how}.steps")
    trainer = TorchTrainer(
        loop,
        train_loop_config={"ckpt_every": 10**9 if how == "notice" else 5, "marker": marker, "log": log},
        scaling_config=ScalingConfig(num_workers=4, use_tpu=True, topology="2x2", accelerator_type="TPU-V6E"),
        run_config=RunConfig(
            storage_path=storage, name=how, failure_config=FailureConfig(max_failures=1), verbose=0
        ),
    )
    event: dict = {}

    def strike() -> None:
        while not os.path.exists(marker):
            time.sleep(0.05)
        node = open(marker).read()
        event["t"] = time.time()
        if how == "notice":
            name = next(s.name for s in cluster.slices if node in s.node_ids)
            event["p"] = cluster.preempt_slice(name, notice_s=10)
        else:
            event["token"] = cluster.kill_host(node)

    thread = threading.Thread(target=strike, daemon=True)
    thread.start()
    result = trainer.fit()
    thread.join()
    if "p" in event:
        event["p"].restore()
    else:
        cluster.restore_host(event["token"])
    seen = [json.loads(line) for line in open(log)]
    first = [m for m in seen if m["attempt"] == 0]
    resumed = [m for m in seen if m["attempt"] == 1]
    before = max(m["step"] for m in first if m["t"] < event["t"])
    # from the reports the driver committed (the attempt may end before rank 0 logs its last step)
    seen = [m["notice_seen_t"] for m in result.metrics_history if m["attempt"] == 0 and m["notice_seen_t"]]
    return {
        "how": how,
        "steps_lost": max(0, before - resumed[0]["resumed_from"]),
        "resume_s": resumed[0]["t"] - event["t"],
        # the drain call (Preemption.noticed_at) -> the loop sees the notice
        "notice_seen_s": min(seen) - event["p"].noticed_at if "p" in event and seen else None,
        "complete": [m["step"] for m in result.metrics_history] == list(range(1, STEPS + 1)),
    }


def serve_case(cluster, model_dir: str) -> dict:
    import httpx
    from ray import serve

    from tpuray.constants import ROLE_LABEL
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, ModelLoadingConfig, build_openai_app
    from tpuray.slices import list_slices

    config = LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id="tiny", model_source=model_dir),
        llm_engine="embedded",
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
        engine_kwargs={"tensor_parallel_size": 4, "max_model_len": 256},
        deployment_config={"ray_actor_options": {"label_selector": {ROLE_LABEL: "head"}}},
    )
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_openai_app(LLMServingArgs(llm_configs=[config], api_key="")), name="spot", route_prefix="/"
    )
    handle = serve.get_deployment_handle("LLMServer:tiny", app_name="spot")
    (busy,) = [s.name for s in list_slices() if s.free_chips < s.chips]
    done: list[tuple[float, float, int]] = []  # (sent, latency, status)
    marks: dict = {}

    async def run() -> None:
        stop = asyncio.Event()

        async def client(i: int, http: httpx.AsyncClient) -> None:
            n = 0
            while not stop.is_set():
                t0 = time.time()
                body = {"model": "tiny", "prompt": f"client {i} request {n}", "max_tokens": 8, "seed": n}
                r = await http.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                done.append((t0, time.time() - t0, r.status_code))
                n += 1

        async with httpx.AsyncClient(timeout=600) as http:
            tasks = [asyncio.create_task(client(i, http)) for i in range(16)]
            await asyncio.sleep(10)
            marks["notice"] = time.time()
            marks["p"] = await asyncio.to_thread(cluster.preempt_slice, busy, 10)
            while (await asyncio.to_thread(lambda: handle.describe.remote().result()))["failovers"] < 1:
                await asyncio.sleep(0.2)
            marks["switched"] = time.time()
            await asyncio.sleep(10)
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    serve.shutdown()
    marks["p"].restore()
    during = [lat for sent, lat, _ in done if marks["notice"] <= sent <= marks["switched"]]
    steady = [lat for sent, lat, _ in done if sent < marks["notice"]]
    return {
        "requests": len(done),
        "failed": sum(status != 200 for _, _, status in done),
        "p50_steady_ms": 1000 * pct(steady, 0.5),
        "p99_steady_ms": 1000 * pct(steady, 0.99),
        "p99_failover_ms": 1000 * pct(during, 0.99) if during else float("nan"),
        "failover_s": marks["switched"] - marks["notice"],
    }


def main() -> int:
    from tpuray.emulator import EmulatedCluster, SliceRequest
    from tpuray.models import build_tiny_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-only", action="store_true", help="skip the serving case")
    args = parser.parse_args()
    os.environ.setdefault("TPURAY_QUIET", "1")
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=2)], head_cpus=4, connect=True) as cluster,
    ):
        print(f"cores: {os.cpu_count()}; {cluster.describe()}")
        rows = [train_case(cluster, how, tmp) for how in ("notice", "hard-kill")]
        print("\ntraining, 4 workers, a step every 0.2 s: preemption notice (10 s) vs hard host kill")
        print(
            f"{'event':<12}{'steps lost':>12}{'event -> resumed (s)':>22}{'drain -> loop sees it (s)':>27}"
            f"{'every step once':>18}"
        )
        for r in rows:
            seen = "-" if r["notice_seen_s"] is None else f"{r['notice_seen_s']:.2f}"
            print(
                f"{r['how']:<12}{r['steps_lost']:>12}{r['resume_s']:>22.1f}{seen:>27}{str(r['complete']):>18}"
            )
        if args.train_only:
            return 0
        model = str(build_tiny_causal_lm(os.path.join(tmp, "model"), max_position_embeddings=512))
        s = serve_case(cluster, model)
        print("\nserving, TP=4 embedded engine, 16 clients, slice preempted with a 10 s notice")
        print(
            f"requests {s['requests']}, failed {s['failed']}; p50/p99 before the notice "
            f"{s['p50_steady_ms']:.0f}/{s['p99_steady_ms']:.0f} ms; p99 of requests sent during the failover "
            f"{s['p99_failover_ms']:.0f} ms; notice -> serving on the spare slice {s['failover_s']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
