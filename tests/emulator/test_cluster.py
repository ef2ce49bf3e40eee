"""The emulated cluster looks like real TPU hosts to Ray: resources, labels, env, emulated markers."""

from __future__ import annotations

import os

import pytest
import ray

from tpuray.emulator import EmulatedCluster, SliceRequest

HOST_ENV = ("TPU_NAME", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY")


def _tpu_nodes() -> list[dict]:
    return sorted(
        (n for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU")),
        key=lambda n: (n["Labels"]["ray.io/tpu-slice-name"], int(n["Labels"]["ray.io/tpu-worker-id"])),
    )


@ray.remote(num_cpus=0)
def _host_env() -> dict[str, str]:
    return {k: os.environ.get(k, "") for k in (*HOST_ENV, "TPURAY_EMULATION")}


def test_default_cluster_nodes(emulated_cluster: EmulatedCluster) -> None:
    assert [s.name for s in emulated_cluster.slices] == ["emulated-v6e-4-0", "emulated-v6e-4-1"]
    assert "emulated" in repr(emulated_cluster)
    nodes = _tpu_nodes()
    assert len(nodes) == 2
    for node, sl in zip(nodes, emulated_cluster.slices, strict=True):
        res, labels = node["Resources"], node["Labels"]
        assert res["TPU"] == 4
        assert res[sl.name] == 1
        assert res["accelerator_type:TPU-V6E"] == 1
        assert res["TPU-v6e-4-head"] == 1
        assert res["CPU"] == 8
        assert labels["ray.io/tpu-slice-name"] == sl.name
        assert labels["ray.io/tpu-worker-id"] == "0"
        assert labels["ray.io/tpu-topology"] == "2x2"
        assert labels["ray.io/tpu-pod-type"] == "v6e-4"
        assert labels["ray.io/accelerator-type"] == "TPU-V6E"
        assert labels["tpuray.io/emulated"] == "true"
        assert node["NodeID"] == sl.node_ids[0]
    head = [n for n in ray.nodes() if n["Alive"] and not n["Resources"].get("TPU")]
    assert len(head) == 1 and "tpuray.io/emulated" not in head[0]["Labels"]


def test_worker_processes_get_host_env(emulated_cluster: EmulatedCluster) -> None:
    for sl in emulated_cluster.slices:
        env = ray.get(_host_env.options(resources={sl.name: 0.001}).remote(), timeout=300)
        assert env == {
            "TPU_NAME": sl.name,
            "TPU_WORKER_ID": "0",
            "TPU_WORKER_HOSTNAMES": sl.hostnames[0],
            "TPU_ACCELERATOR_TYPE": "v6e-4",
            "TPU_TOPOLOGY": "2x2",
            "TPURAY_EMULATION": "1",
        }
    # The driver runs on the CPU head: not an emulated TPU host.
    assert os.environ.get("TPURAY_EMULATION") is None


def test_ray_counts_emulated_slices(emulated_cluster: EmulatedCluster) -> None:
    from ray.util.tpu import get_num_ready_tpu_slices

    assert get_num_ready_tpu_slices("2x2", "TPU-V6E") == 2


def test_bad_requests_raise_before_starting() -> None:
    with pytest.raises(ValueError, match="3x3"):
        SliceRequest("TPU-V6E", "3x3")
    with pytest.raises(ValueError, match="count"):
        SliceRequest("TPU-V6E", "2x2", count=0)
    with pytest.raises(ValueError, match="TPU-V99"):
        SliceRequest("TPU-V99", "2x2")
    with pytest.raises(ValueError, match="at least one"):
        EmulatedCluster([])


def test_kill_and_restore_host(emulated_cluster: EmulatedCluster) -> None:
    sl = emulated_cluster.slices[1]
    old = sl.node_ids[0]
    token = emulated_cluster.kill_host(old)
    assert token == (sl.name, 0)
    assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == old)  # kill_host waits for this
    new = emulated_cluster.restore_host(token)
    assert new != old and sl.node_ids == [new]
    (node,) = [n for n in ray.nodes() if n["NodeID"] == new]
    assert node["Alive"] and node["Labels"]["ray.io/tpu-slice-name"] == sl.name
    assert node["Resources"]["TPU-v6e-4-head"] == 1
    with pytest.raises(ValueError, match="not an emulated TPU host"):
        emulated_cluster.kill_host("f" * 56)


def test_preempt_slice_drains_then_kills_then_restores(emulated_cluster: EmulatedCluster) -> None:
    from tpuray.slices.drain import DrainWatch, draining_nodes

    sl = emulated_cluster.slices[1]
    old = sl.node_ids[0]

    @ray.remote(num_cpus=0, resources={"TPU": 1})
    class OnSlice:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    # A busy host (an idle one's raylet exits as soon as it is drained, as on real Ray clusters).
    busy = OnSlice.options(label_selector={"ray.io/tpu-slice-name": sl.name}).remote()
    assert ray.get(busy.node.remote(), timeout=60) == old
    watch = DrainWatch({old: [0, 1, 2, 3]}, min_interval_s=0)
    assert watch.poll() is None
    preemption = emulated_cluster.preempt_slice(sl.name, notice_s=3, restore_after_s=0)
    assert "EMULATED" in repr(preemption)
    # Ray's own drain state: the node drains with the notice's deadline; what runs there keeps running
    # until the deadline, and new work pinned to the slice waits.
    assert draining_nodes()[old] == int(preemption.deadline * 1000)
    info = watch.poll()
    assert info.preempted_node_to_ranks == {old: [0, 1, 2, 3]} and 0 < info.seconds_left() <= 3
    assert ray.get(busy.node.remote(), timeout=10) == old
    pinned = OnSlice.options(label_selector={"ray.io/tpu-slice-name": sl.name}).remote()
    ready, _ = ray.wait([pinned.node.remote()], timeout=1.0)
    assert not ready
    assert preemption.wait_killed(timeout_s=60)
    assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == old)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(busy.node.remote(), timeout=60)
    assert preemption.wait_restored(timeout_s=120)
    (new,) = preemption.restored_node_ids
    again = OnSlice.options(label_selector={"ray.io/tpu-slice-name": sl.name}).remote()
    assert sl.node_ids == [new] and ray.get(again.node.remote(), timeout=60) == new  # the replacement
    ray.kill(again)


def test_preempt_refuses_bad_targets(emulated_cluster: EmulatedCluster) -> None:
    with pytest.raises(ValueError, match="no emulated slice 'nope'"):
        emulated_cluster.preempt_slice("nope")
    with pytest.raises(ValueError, match="not an emulated TPU host"):
        emulated_cluster.preempt_host("f" * 56)
    with pytest.raises(ValueError, match="notice_s=-1"):
        emulated_cluster.preempt_slice(emulated_cluster.slices[0].name, notice_s=-1)
