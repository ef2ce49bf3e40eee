"""An embedded engine that dies under load leaves no zombie replica (issue 22, item 2): its requests, in
flight and after, get a 503 OpenAI error (never a 500, never a hang), the replica fails its health check,
Serve replaces it, and the app answers 200 again on a fresh reservation of a slice, the dead engine's
placement group released. CI kills an engine worker's process; the full tier also kills a whole host of
the slice the replacement took. (vLLM's engine core: test_vllm.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _configs import MAX_MODEL_LEN
from _engine_death import Load, kill_under_load

from _util import live_placement_groups, new_placement_groups
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
    return new


@pytest.fixture
def death_app(serve_url, pg_leak_check, tiny_model_dir) -> Iterator[tuple[Any, Load, set[str]]]:
    """The app (one replica on the CPU head, its engine on a 2x2 slice), its load and the placement
    groups alive before it; deleted after the test, its slice's placement group with it."""
    from ray import serve

    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    before = set(live_placement_groups())
    config = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": tiny_model_dir},
        llm_engine="embedded",
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
        # one engine worker holding the slice's 4 chips: one process to start per replacement, not 4
        placement_group_config={"bundle_per_worker": {"TPU": 4}},
        engine_kwargs={"tensor_parallel_size": 1, "max_model_len": MAX_MODEL_LEN},
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


def test_a_dead_engine_worker_gets_503s_then_a_new_replica(death_app) -> None:
    def kill_worker(engine: dict) -> None:
        (worker,) = engine["workers"]
        os.kill(worker["pid"], signal.SIGKILL)

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
