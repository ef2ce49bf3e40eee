"""An embedded engine that dies under load is never served dead (issue 22, item 2): its requests, in
flight and after, get a 503 OpenAI error with Retry-After (never a 500, never a hang), the replica starts
a new engine in place of the dead one, on a fresh reservation of a slice, the dead engine's placement
group released, and the app answers 200 again from the same replica. CI kills one engine worker's process
at tensor_parallel_size 2 (issue 45: the other rank lives on), and loses the engine's host while the
other slice is held, so that no new engine can start for longer than Serve took to replace a replica
failing its health check: requests still get the 503 at once (issue 45, item 2). The full tier kills a
worker at TP 1 and 4, and loses the host of the slice a new engine took. (vLLM's engine core:
test_vllm.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _configs import MAX_MODEL_LEN
from _engine_death import Load, answers_for, answers_until_served, kill_under_load

from _util import live_placement_groups, live_processes, new_placement_groups
from tpuray.constants import ROLE_LABEL

APP = "death"
HEALTH_CHECK_PERIOD_S = 2  # Serve would replace a replica failing 3 checks in a row: about 6 s


def _engine(handle) -> tuple[dict, set[str]]:
    """The replica's engine (describe()) and the placement groups alive now."""
    return handle.describe.remote().result(), set(live_placement_groups())


def _check_replaced(handle, before: set[str], old_pgs: set[str], old: dict) -> dict:
    """The engine serving now is a new one, on new placement groups; the old one's are released."""
    new, pgs = _engine(handle)
    assert new["replica_pid"] == old["replica_pid"], "Serve replaced the replica: its ingress went away"
    assert (new["restarts"], new["state"]) == (old["restarts"] + 1, "serving"), new
    assert {w["pid"] for w in new["workers"]}.isdisjoint(w["pid"] for w in old["workers"])
    assert not (pgs - before) & old_pgs, "the dead engine's placement group was not released"
    assert len(pgs - before) == len(old_pgs), f"placement groups now: {pgs - before}, before: {old_pgs}"
    left = live_processes([w["pid"] for w in old["workers"]])
    assert not left, f"the dead engine's worker processes {left} outlived it"
    return new


FULL_TP = (
    "CI: a dead engine worker at tensor_parallel_size 2 "
    "(test_a_dead_engine_worker_gets_503s_then_a_new_engine[tp2])"
)


@pytest.fixture
def death_app(request, serve_url, pg_leak_check, tiny_model_dir) -> Iterator[tuple[Any, Load, set[str]]]:
    """The app (one replica on the CPU head, its engine on a 2x2 slice at tensor_parallel_size
    `request.param`, default 2), its load and the placement groups alive before it; deleted after the
    test, its slice's placement group with it."""
    from ray import serve

    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    tp = getattr(request, "param", 2)
    before = set(live_placement_groups())
    config = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
        llm_engine="embedded",
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
        # TP engine workers share the slice's 4 chips: 2 processes to start per replacement in CI, not 4
        placement_group_config={"bundle_per_worker": {"TPU": 4 // tp}},
        engine_kwargs={"tensor_parallel_size": tp, "max_model_len": MAX_MODEL_LEN},
        deployment_config={
            # the replica on the CPU head, its engine on a slice: a host death takes the engine only
            "ray_actor_options": {"label_selector": {ROLE_LABEL: "head"}},
            "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        },
    )
    try:
        serve.run(build_openai_app(LLMServingArgs(llm_configs=[config])), name=APP, route_prefix="/")
        handle = serve.get_deployment_handle("LLMServer:tiny", app_name=APP)
        yield handle, Load(f"{serve_url}/v1/completions", "tiny"), before
    finally:
        serve.delete(APP)
    assert not new_placement_groups(before), "the app's slice placement group outlived it"


def _killed_under_load(handle, load: Load, before: set[str], kill: Callable[[dict], None]) -> dict:
    """Kill (kill(engine description)) under load: only 200s and 503s, then a new engine on new
    placement groups, the old ones released. Returns the new engine's description."""
    old, pgs = _engine(handle)
    old_pgs = pgs - before
    assert old_pgs  # the slice's reservation
    answers = asyncio.run(kill_under_load(load, lambda: kill(old)))
    assert set(answers) <= {"ok", "503"}, answers  # nothing else: no 500, no hang
    return _check_replaced(handle, before, old_pgs, old)


@pytest.mark.parametrize(
    "death_app",
    [2, pytest.param(1, marks=pytest.mark.full(FULL_TP)), pytest.param(4, marks=pytest.mark.full(FULL_TP))],
    indirect=True,
    ids=lambda tp: f"tp{tp}",
)
def test_a_dead_engine_worker_gets_503s_then_a_new_engine(death_app) -> None:
    def kill_worker(engine: dict) -> None:
        workers = engine["workers"]
        assert len(workers) == engine["tensor_parallel_size"], workers  # one worker per TP rank
        os.kill(workers[-1]["pid"], signal.SIGKILL)  # at TP > 1 a rank whose peers live on

    _killed_under_load(*death_app, kill_worker)


@pytest.mark.full(
    "CI: a killed engine worker's process (test_a_dead_engine_worker_gets_503s_then_a_new_engine), a "
    "lost host under training (train/test_fault_tolerance.py), a preempted slice under serving "
    "(serve/deployments/test_failover.py)"
)
def test_a_lost_host_gets_503s_then_a_new_engine_on_the_other_slice(emulated_cluster, death_app) -> None:
    lost: list[Any] = []

    def kill_host(engine: dict) -> None:
        lost.append(emulated_cluster.kill_host(engine["workers"][0]["node_id"]))

    try:
        old, _ = _engine(death_app[0])
        new = _killed_under_load(*death_app, kill_host)
        host = old["workers"][0]["node_id"]
        assert host not in {w["node_id"] for w in new["workers"]}  # on the other slice
    finally:
        for host in lost:
            emulated_cluster.restore_host(host)


def test_no_free_slice_keeps_503s_with_retry_after_coming_until_one_is(
    emulated_cluster, serve_url, death_app
) -> None:
    """The engine's host lost while the test holds the other slice: no new engine can start for 10 health
    check periods, past the point where Serve replaced a replica failing its checks (its proxy then held
    every new request until a new replica served: minutes on a loaded machine). Every request meanwhile
    gets the 503 with Retry-After from the same replica, /health and /v1/models say the model is
    recovering; once the slice is free, a new engine takes it and requests are served again."""
    import httpx

    from tpuray.slices import SlicePlacementGroup

    handle, _, before = death_app
    old, pgs = _engine(handle)
    lost = None
    held = SlicePlacementGroup("2x2", "v6e", timeout_s=60)  # the other slice
    try:
        lost = emulated_cluster.kill_host(old["workers"][0]["node_id"])
        during = asyncio.run(answers_for(serve_url, "tiny", seconds=10 * HEALTH_CHECK_PERIOD_S))
        health = httpx.get(f"{serve_url}/health", timeout=60)
        card = httpx.get(f"{serve_url}/v1/models", timeout=60).json()["data"][0]
        held.shutdown()
        after = asyncio.run(answers_until_served(serve_url, "tiny"))
        assert during and all(a.dead_with_retry_after for a in during), during
        assert health.status_code == 503 and health.headers["retry-after"].isdigit(), health.headers
        assert health.json() == {"status": "unavailable", "models": {"tiny": "recovering"}}
        assert card["status"] == "recovering", card
        assert all(a.dead_with_retry_after for a in after[:-1]), after
        _check_replaced(handle, before, pgs - before, old)
        assert httpx.get(f"{serve_url}/health", timeout=60).json() == {
            "status": "ok",
            "models": {"tiny": "serving"},
        }
    finally:
        held.shutdown()
        if lost is not None:
            emulated_cluster.restore_host(lost)
