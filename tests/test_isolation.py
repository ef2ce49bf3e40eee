"""Per-chip isolation: Ray assigns chips (TPU_VISIBLE_CHIPS), tpuray.isolation adds the slice-wide env."""

from __future__ import annotations

import os
import time

import pytest
import ray

from tpuray.isolation import process_env

HOST_4X4_W1 = {
    "TPU_NAME": "s",
    "TPU_WORKER_ID": "1",
    "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3",
    "TPU_ACCELERATOR_TYPE": "v6e-16",
    "TPU_TOPOLOGY": "4x4",
}


def test_process_env_from_host_env_and_assigned_chip() -> None:
    env = process_env({**HOST_4X4_W1, "TPU_VISIBLE_CHIPS": "2"})
    assert env["TPU_VISIBLE_CHIPS"] == "2"
    assert env["CLOUD_TPU_TASK_ID"] == "6"  # worker 1 x 4 chips + local chip 2
    assert env["TPU_WORKER_ID"] == "1" and env["TPU_NAME"] == "s"
    assert env["TPU_PROCESS_BOUNDS"] == "4,4,1" and env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    assert env["TPU_PROCESS_ADDRESSES"].split(",")[6] == "h1:8478"


def test_process_env_two_chip_share() -> None:
    env = process_env({**HOST_4X4_W1, "TPU_VISIBLE_CHIPS": "2,3"})
    assert env["TPU_VISIBLE_CHIPS"] == "2,3" and env["CLOUD_TPU_TASK_ID"] == "3"


def test_process_env_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        process_env({**HOST_4X4_W1, "TPU_VISIBLE_CHIPS": "1,2"})
    with pytest.raises(ValueError, match="TPU_VISIBLE_CHIPS"):
        process_env({**HOST_4X4_W1, "TPU_VISIBLE_CHIPS": "zero"})
    with pytest.raises(RuntimeError, match="not on a TPU host"):
        process_env({"TPU_VISIBLE_CHIPS": "0"})
    with pytest.raises(ValueError, match="TPU_WORKER_ID"):
        process_env({**HOST_4X4_W1, "TPU_WORKER_ID": "7", "TPU_VISIBLE_CHIPS": "0"})


@ray.remote(num_cpus=0)
class Holder:
    def chips(self) -> tuple[str, str, list[str]]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), os.environ["TPU_VISIBLE_CHIPS"], ctx.get_accelerator_ids()["TPU"]

    def process_env(self) -> dict:
        return process_env()


def test_no_two_live_actors_share_a_chip(emulated_cluster) -> None:
    holders = [Holder.options(resources={"TPU": 1}).remote() for _ in range(8)]
    try:
        got = ray.get([a.chips.remote() for a in holders], timeout=300)
        envs = ray.get([a.process_env.remote() for a in holders], timeout=300)
        assert ray.available_resources().get("TPU", 0) == 0  # all 8 chips held
        held = [(node, int(visible)) for node, visible, _ in got]
        assert len(set(held)) == 8  # every chip held exactly once
        for (_node, visible, ids), env in zip(got, envs, strict=True):
            assert visible == ",".join(ids) == env["TPU_VISIBLE_CHIPS"]  # Ray's choice is kept
    finally:
        for a in holders:
            ray.kill(a)


def test_unaligned_two_chip_share_is_refused_clearly(emulated_cluster) -> None:
    """Ray hands out a host's lowest free chips and knows nothing of TPU alignment: a pair placed on a
    host where a single already holds chip 0 gets chips 1,2, which libtpu cannot address."""
    from ray._private.state import available_resources_per_node
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = emulated_cluster.slices[0].node_ids[0]
    deadline = time.monotonic() + 60  # chips of actors killed by earlier tests come back asynchronously
    while available_resources_per_node().get(node, {}).get("TPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    on_host = NodeAffinitySchedulingStrategy(node, soft=False)
    single = Holder.options(resources={"TPU": 1}, scheduling_strategy=on_host).remote()
    pair = None
    try:
        assert ray.get(single.chips.remote(), timeout=300)[1] == "0"
        pair = Holder.options(resources={"TPU": 2}, scheduling_strategy=on_host).remote()
        assert ray.get(pair.chips.remote(), timeout=300)[1] == "1,2"
        with pytest.raises(ValueError, match=r"chips \[1, 2\] are not an aligned share .* multiple of 2"):
            ray.get(pair.process_env.remote(), timeout=300)
    finally:
        for a in (single, pair):
            if a is not None:
                ray.kill(a)
