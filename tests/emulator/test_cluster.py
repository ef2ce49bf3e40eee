"""The emulated cluster looks like real TPU hosts to Ray: resources, labels, env, emulated markers."""

from __future__ import annotations

import os
import re
import time

import pytest
import ray

from tpuray.emulator import EmulatedCluster, SliceRequest
from tpuray.slices.drain import PREEMPTED_DEATH

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


def test_a_slice_added_by_hand_can_be_removed(emulated_cluster: EmulatedCluster) -> None:
    from tpuray.slices import list_slices
    from tpuray.validation import ConfigError

    requests = list(emulated_cluster.requests)
    (added,) = emulated_cluster.add_slices(SliceRequest("TPU-V5E", "1x1"))
    assert added.name == "emulated-v5litepod-1-0" and added.name in {s.name for s in list_slices()}
    with pytest.raises(ConfigError, match="cannot remove 'emulated-v6e-4-0' before 'emulated-v6e-4-1'"):
        emulated_cluster.remove_slice("emulated-v6e-4-0")
    emulated_cluster.remove_slice(added.name)
    deadline = time.monotonic() + 60
    while added.name in {s.name for s in list_slices()} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert added.name not in {s.name for s in list_slices()}
    # a restart starts the cluster it was before the slice came
    assert emulated_cluster.requests == requests
    assert [s.name for s in emulated_cluster.slices] == ["emulated-v6e-4-0", "emulated-v6e-4-1"]
    with pytest.raises(ConfigError, match="no emulated slice 'emulated-v5litepod-1-0'"):
        emulated_cluster.remove_slice(added.name)


def test_bad_requests_raise_before_starting() -> None:
    with pytest.raises(ValueError, match="3x3"):
        SliceRequest("TPU-V6E", "3x3")
    with pytest.raises(ValueError, match="count"):
        SliceRequest("TPU-V6E", "2x2", count=0)
    with pytest.raises(ValueError, match="TPU-V99"):
        SliceRequest("TPU-V99", "2x2")
    with pytest.raises(ValueError, match="at least one"):
        EmulatedCluster([])
    one = [SliceRequest("TPU-V6E", "2x2")]
    for bad in (0, 1.5, True):  # the shared validator: an int, not a bool, >= 1
        with pytest.raises(
            ValueError, match=re.escape(f"cpus_per_chip={bad!r} is invalid: use an integer >= 1")
        ):
            EmulatedCluster(one, cpus_per_chip=bad)
    with pytest.raises(ValueError, match=re.escape("head_cpus=-1 is invalid: use an integer >= 0")):
        EmulatedCluster(one, head_cpus=-1)


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
    # Ray recorded why the host went: the drain's reason (PREEMPTION) and message.
    assert _death(old) == (PREEMPTED_DEATH, f"emulated preemption of {sl.name}")
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(busy.node.remote(), timeout=60)
    assert died.value.preempted  # what Ray tells the owner of an actor lost that way
    assert preemption.wait_restored(timeout_s=120)
    (new,) = preemption.restored_node_ids
    again = OnSlice.options(label_selector={"ray.io/tpu-slice-name": sl.name}).remote()
    assert sl.node_ids == [new] and ray.get(again.node.remote(), timeout=60) == new  # the replacement
    ray.kill(again)


def _death(node_id: str) -> tuple[str, str]:
    """Ray's record of a dead node: (NodeDeathInfo reason name, message), from ray.nodes()."""
    from ray.core.generated.common_pb2 import NodeDeathInfo

    (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
    assert not node["Alive"]
    return NodeDeathInfo.Reason.Name(node["DeathReason"]), node["DeathReasonMessage"]


def test_preempt_host_drains_that_host_only_then_kills_it_at_the_deadline(
    emulated_cluster: EmulatedCluster,
) -> None:
    from tpuray.slices.drain import dead_nodes, draining_nodes

    sl, other = emulated_cluster.slices[1], emulated_cluster.slices[0]
    node, bystander = sl.node_ids[0], other.node_ids[0]

    @ray.remote(num_cpus=0, resources={"TPU": 1})
    class OnHost:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    busy = OnHost.options(label_selector={"ray.io/tpu-slice-name": sl.name}).remote()  # keeps it draining
    assert ray.get(busy.node.remote(), timeout=60) == node
    preemption = emulated_cluster.preempt_host(node, notice_s=5)
    try:
        assert preemption.node_ids == [node]
        # Ray's drain state: this host, with the notice's deadline (UNIX ms); no other host drains.
        draining = draining_nodes()
        assert draining[node] == int(preemption.deadline * 1000) and bystander not in draining
        assert ray.get(busy.node.remote(), timeout=10) == node  # still running during the notice
        assert preemption.wait_killed(timeout_s=60)
        assert time.time() >= preemption.deadline  # killed at the deadline, not before
        # Ray's record of the death: the drain's reason (PREEMPTION) and message; the bystander lives.
        assert _death(node) == (PREEMPTED_DEATH, "emulated spot preemption (5s notice)")
        assert dead_nodes([node, bystander]) == {node: True}
        assert node not in draining_nodes()
        with pytest.raises(ray.exceptions.RayActorError) as died:
            ray.get(busy.node.remote(), timeout=60)
        assert died.value.preempted
    finally:
        (new,) = preemption.restore()  # the node pool's replacement
    assert sl.node_ids == [new] and new != node and other.node_ids == [bystander]
    assert preemption.restore() == [new]  # restoring twice brings nothing more back


def test_preempt_refuses_bad_targets(emulated_cluster: EmulatedCluster) -> None:
    with pytest.raises(ValueError, match="no emulated slice 'nope'"):
        emulated_cluster.preempt_slice("nope")
    with pytest.raises(ValueError, match="not an emulated TPU host"):
        emulated_cluster.preempt_host("f" * 56)
    with pytest.raises(ValueError, match="notice_s=-1"):
        emulated_cluster.preempt_slice(emulated_cluster.slices[0].name, notice_s=-1)
