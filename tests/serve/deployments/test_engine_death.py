"""An embedded engine that dies under load leaves no zombie replica (issue 22, item 2): its requests, in
flight and after, get a 503 OpenAI error (never a 500, never a hang), the replica fails its health check,
Serve replaces it, and the app answers 200 again on a fresh reservation of a slice, the dead engine's
placement group released. CI kills one engine worker's process at tensor_parallel_size 2 (issue 45: the
other rank lives on); the full tier also at TP 1 and 4, and kills a whole host of the slice the
replacement took. (vLLM's engine core: test_vllm.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _configs import MAX_MODEL_LEN
from _engine_death import Load, kill_under_load

from _util import live_placement_groups, live_processes, new_placement_groups
from tpuray.constants import ROLE_LABEL

APP = "death"


def _engine(handle) -> tuple[dict, set[str]]:
    """The replica's engine (describe()) and the placement groups alive now."""
    return handle.describe.remote().result(), set(live_placement_groups())


def _check_replaced(handle, before: set[str], old_pgs: set[str], old: dict) -> dict:
    """The engine serving now is a new one, on new placement groups; the old one's are released."""
    new, pgs = _engine(handle)
    assert {w["pid"] for w in new["workers"]}.isdisjoint(w["pid"] for w in old["workers"])
    assert not (pgs - before) & old_pgs, "the dead engine's placement group was not released"
    assert len(pgs - before) == len(old_pgs), f"placement groups now: {pgs - before}, before: {old_pgs}"
    left = live_processes([w["pid"] for w in old["workers"]])
    assert not left, f"the dead engine's worker processes {left} outlived it"
    return new


FULL_TP = (
    "CI: a dead engine worker at tensor_parallel_size 2 "
    "(test_a_dead_engine_worker_gets_503s_then_a_new_replica[tp2])"
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
            "health_check_period_s": 2,  # Serve replaces a replica after 3 failed checks in a row
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
def test_a_dead_engine_worker_gets_503s_then_a_new_replica(death_app) -> None:
    def kill_worker(engine: dict) -> None:
        workers = engine["workers"]
        assert len(workers) == engine["tensor_parallel_size"], workers  # one worker per TP rank
        os.kill(workers[-1]["pid"], signal.SIGKILL)  # at TP > 1 a rank whose peers live on

    _killed_under_load(*death_app, kill_worker)


@pytest.mark.full(
    "CI: a killed engine worker's process (test_a_dead_engine_worker_gets_503s_then_a_new_replica), a "
    "lost host under training (train/test_fault_tolerance.py), a preempted slice under serving "
    "(serve/deployments/test_failover.py)"
)
def test_a_lost_host_gets_503s_then_a_new_replica_on_the_other_slice(emulated_cluster, death_app) -> None:
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
