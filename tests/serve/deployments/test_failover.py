"""Serving through a spot preemption: a replica on a preempted emulated slice moves its engine to the
spare slice while 8 clients keep sending requests (half of them streamed), and none of them fails: every
response is a 200, every stream ends with [DONE] and carries no error event."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from _configs import tiny_tp4_config
from _engine_death import check_the_deadline_ends_a_running_stream

from tpuray.constants import ROLE_LABEL


def _busy_slice() -> str:
    from tpuray.slices import list_slices

    (busy,) = [s.name for s in list_slices() if s.free_chips < s.chips]
    return busy


def test_preempted_replica_fails_over_with_no_failed_request(
    emulated_cluster, serve_url, pg_leak_check, tiny_model_dir
) -> None:
    from ray import serve

    from tpuray.serve.llm import LLMServingArgs, build_openai_app

    preemption = None
    try:
        config = tiny_tp4_config(tiny_model_dir)
        # The replica on the CPU head, its engine on a slice: the replica itself moves the engine. (A
        # replica on a draining host is moved by Ray Serve itself, replica and engine together.)
        config.deployment_config = {"ray_actor_options": {"label_selector": {ROLE_LABEL: "head"}}}
        app = build_openai_app(LLMServingArgs(llm_configs=[config], api_key=""))
        serve.run(app, name="spot", route_prefix="/")
        handle = serve.get_deployment_handle("LLMServer:tiny", app_name="spot")
        first_slice = _busy_slice()
        outcomes: list[tuple[bool, int, bool]] = []  # (streamed, HTTP status, complete) per request
        url = f"{serve_url}/v1/completions"

        async def load() -> None:
            nonlocal preemption
            stop = asyncio.Event()

            async def streamed(http: httpx.AsyncClient, body: dict) -> tuple[bool, int, bool]:
                async with http.stream("POST", url, json={**body, "stream": True}) as r:
                    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                ok = bool(events) and events[-1] == "[DONE]"
                ok = ok and not any("error" in json.loads(e) for e in events[:-1])
                return True, r.status_code, ok

            async def client(i: int, http: httpx.AsyncClient) -> None:
                n = 0
                while not stop.is_set():
                    body = {"model": "tiny", "prompt": f"client {i} req {n}", "max_tokens": 4, "seed": n}
                    if i % 2:  # half the clients stream
                        outcomes.append(await streamed(http, body))
                    else:
                        r = await http.post(url, json=body)
                        outcomes.append(
                            (False, r.status_code, r.status_code == 200 and "choices" in r.json())
                        )
                    n += 1

            async with httpx.AsyncClient(timeout=300) as http:
                clients = [asyncio.create_task(client(i, http)) for i in range(8)]
                while len(outcomes) < 32:
                    await asyncio.sleep(0.1)
                # 20 s notice (GCE gives spot VMs 30 s): the requests on the old engine must finish before
                # the deadline while the replacement's workers start on the same 2 cores; at the deadline
                # they would fail (the next test)
                preemption = await asyncio.to_thread(emulated_cluster.preempt_slice, first_slice, 20)
                deadline = time.monotonic() + 300
                while (await asyncio.to_thread(lambda: handle.describe.remote().result()))["failovers"] < 1:
                    assert time.monotonic() < deadline, "the replica never moved its engine"
                    await asyncio.sleep(0.2)
                after = len(outcomes)
                while len(outcomes) < after + 32:  # served on the replacement
                    await asyncio.sleep(0.1)
                stop.set()
                await asyncio.gather(*clients)

        asyncio.run(load())
        failed = [(streamed, status) for streamed, status, ok in outcomes if status != 200 or not ok]
        assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {sorted(set(failed))}"
        assert sum(streamed for streamed, _, _ in outcomes) >= 16  # streams ran through the failover
        assert _busy_slice() != first_slice  # the engine runs on the spare slice now
        assert handle.describe.remote().result()["failovers"] == 1
    finally:
        serve.delete("spot")
        if preemption is not None:
            preemption.restore()  # the node pool brings the preempted slice back


def test_request_running_at_the_preemption_deadline_fails_with_a_503_not_a_hang(tiny_model_dir) -> None:
    """The engine of a preempted slice is shut down at the deadline; a request still on it ends with the
    replica's 503 (engine_dead, naming the preemption) instead of waiting forever. In this process: the
    slot's retirement of the old engine, with a deadline already past, while a stream runs on it."""
    from tpuray.serve.llm import LLMConfig

    config = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
        llm_engine="embedded",
        engine_kwargs={"max_model_len": 128, "max_num_seqs": 2},
    )
    check_the_deadline_ends_a_running_stream(config, "tiny", timeout_s=120)
