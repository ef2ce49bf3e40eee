"""An embedded engine that dies under load leaves no zombie replica (issue 22, item 2): its requests, in
flight and after, get a 503 OpenAI error (never a 500, never a hang), the replica fails its health check,
Serve replaces it, and the app answers 200 again on a fresh reservation of a slice, the dead engine's
placement group released. Twice on one deployment: an engine worker's process is killed, then a whole
host of the slice the replacement took. (vLLM's engine core: test_vllm.py.)"""

from __future__ import annotations

import asyncio
import os
import signal

from _configs import MAX_MODEL_LEN
from _engine_death import Load, kill_under_load

from _util import live_placement_groups, new_placement_groups
from tpuray.constants import ROLE_LABEL


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


def test_a_dead_engine_worker_or_host_gets_503s_then_a_new_replica(
    emulated_cluster, serve_url, pg_leak_check, tiny_model_dir
) -> None:
    from ray import serve

    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    before = set(live_placement_groups())
    lost_host = None
    try:
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
        serve.run(build_openai_app(LLMServingArgs(llm_configs=[config])), name="death", route_prefix="/")
        handle = serve.get_deployment_handle("LLMServer:tiny", app_name="death")
        load = Load(f"{serve_url}/v1/completions", "tiny")

        first, pgs = _engine(handle)
        first_pgs = pgs - before
        assert first_pgs  # the slice's reservation
        (worker,) = first["workers"]
        worker_kill = asyncio.run(kill_under_load(load, lambda: os.kill(worker["pid"], signal.SIGKILL)))
        assert set(worker_kill) <= {"ok", "503"}, worker_kill  # nothing else: no 500, no hang
        second = _check_replaced(handle, before, first_pgs, first)

        second_pgs = set(live_placement_groups()) - before
        host = second["workers"][0]["node_id"]

        def kill_host() -> None:
            nonlocal lost_host
            lost_host = emulated_cluster.kill_host(host)

        host_kill = asyncio.run(kill_under_load(load, kill_host))
        assert set(host_kill) <= {"ok", "503"}, host_kill
        third = _check_replaced(handle, before, second_pgs, second)
        assert host not in {w["node_id"] for w in third["workers"]}  # on the other slice
    finally:
        serve.delete("death")
        if lost_host is not None:
            emulated_cluster.restore_host(lost_host)
    assert not new_placement_groups(before), "the app's slice placement group outlived it"
