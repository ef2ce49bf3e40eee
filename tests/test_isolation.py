"""Per-chip isolation: Ray assigns chips (TPU_VISIBLE_CHIPS), tpuray.isolation adds the slice-wide env."""

from __future__ import annotations

import os

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
    def chips(self) -> tuple[str, str, list[str], dict]:
        ctx = ray.get_runtime_context()
        return (
            ctx.get_node_id(),
            os.environ["TPU_VISIBLE_CHIPS"],
            ctx.get_accelerator_ids()["TPU"],
            process_env(),
        )


def test_no_two_live_actors_share_a_chip(emulated_cluster) -> None:
    # Ray hands out a host's lowest free chips and knows nothing of TPU alignment: a pair placed on a
    # host where a single already holds chip 0 gets the unaligned chips 1,2 (process_env rejects that,
    # tested above). So the pairs are placed first, on free hosts, then the singles fill the rest.
    pairs = [Holder.options(resources={"TPU": 2}).remote() for _ in range(2)]
    singles: list = []
    try:
        got_pairs = ray.get([a.chips.remote() for a in pairs], timeout=300)
        singles = [Holder.options(resources={"TPU": 1}).remote() for _ in range(4)]
        got = ray.get([a.chips.remote() for a in singles], timeout=300) + got_pairs
        assert ray.available_resources().get("TPU", 0) == 0  # all 8 chips held
        held = [(node, int(c)) for node, visible, _, _ in got for c in visible.split(",")]
        assert len(held) == 8 and len(set(held)) == 8  # every chip held exactly once
        for _node, visible, ids, env in got:
            assert visible == ",".join(ids) == env["TPU_VISIBLE_CHIPS"]  # Ray's choice is kept
        assert all(len(v.split(",")) == 2 for _, v, _, _ in got[4:])
    finally:
        for a in singles + pairs:
            ray.kill(a)
