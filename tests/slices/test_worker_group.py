"""SliceWorkerGroup: the one per-chip worker group of training and serving.

Rank assignment is a pure function of (bundle, placement) and is tested on its own; the group itself runs
on the shared emulated cluster (two v6e 2x2 slices).
"""

from __future__ import annotations

import random
import time

import pytest
import ray

from tpuray.slices import (
    PlacementError,
    SliceWorker,
    SliceWorkerGroup,
    WorkerGroupSpec,
    WorkerPlacement,
    assign_ranks,
)
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError

V6E_16 = SliceTopology.parse("TPU-V6E", "4x4")
HOSTS = "10.0.0.10,10.0.0.11,10.0.0.12,10.0.0.13"


def _placement(slice_name: str, worker: int, chips: tuple[int, ...], hostnames: str | None = HOSTS):
    host_env = [
        ("TPU_NAME", slice_name),
        ("TPU_WORKER_ID", str(worker)),
        ("TPU_ACCELERATOR_TYPE", "v6e-16"),
        ("TPU_TOPOLOGY", "4x4"),
    ]
    if hostnames:
        host_env.append(("TPU_WORKER_HOSTNAMES", hostnames))
    return WorkerPlacement(
        node_id=f"{slice_name}-node{worker}",
        node_ip=f"192.168.{worker}.1",
        pid=1000 + worker,
        tpu_chips=chips,
        host_env=tuple(host_env),
    )


def _bundles(spec: WorkerGroupSpec, chips_per_worker: int = 1, names=("s0",)):
    """(bundle, placement) of every worker, chips in Ray's per-host order, shuffled."""
    placed = []
    per_host = 4 // chips_per_worker
    for s, name in enumerate(names):
        for host in range(4):
            for share in range(per_host):
                bundle = s * 16 // chips_per_worker + host * per_host + share
                chips = tuple(range(share * chips_per_worker, (share + 1) * chips_per_worker))
                placed.append((bundle, _placement(name, host, chips)))
    random.Random(0).shuffle(placed)
    return placed


def test_ranks_follow_slice_position_not_start_order() -> None:
    spec = WorkerGroupSpec(num_workers=32, topology=V6E_16, num_slices=2)
    placed = _bundles(spec, names=("s0", "s1"))
    ranked = assign_ranks(spec, placed)
    for (bundle, pl), (rank, env) in zip(placed, ranked, strict=True):
        slice_index, host = bundle // 16, (bundle % 16) // 4
        assert rank.world_rank == slice_index * 16 + host * 4 + pl.tpu_chips[0]
        assert rank.slice_index == slice_index and rank.slice_rank == rank.world_rank % 16
        assert rank.local_rank == pl.tpu_chips[0] and rank.local_world_size == 4  # LOCAL_RANK == chip
        assert rank.node_rank == slice_index * 4 + host and rank.world_size == 32
        assert env["TPU_VISIBLE_CHIPS"] == str(pl.tpu_chips[0])  # Ray's choice kept
        assert env["CLOUD_TPU_TASK_ID"] == str(rank.slice_rank)
        assert env["TPU_WORKER_HOSTNAMES"] == HOSTS  # the one hostname rule: the slice's host env first
        assert env["TPU_NAME"] == pl.slice_name
    assert sorted(r.world_rank for r, _ in ranked) == list(range(32))


def test_hostnames_fall_back_to_node_ips() -> None:
    spec = WorkerGroupSpec(num_workers=16, topology=V6E_16)
    placed = [
        (b, _placement(pl.slice_name, pl.worker_id, pl.tpu_chips, hostnames=None)) for b, pl in _bundles(spec)
    ]
    _, env = assign_ranks(spec, placed)[0]
    assert env["TPU_WORKER_HOSTNAMES"] == "192.168.0.1,192.168.1.1,192.168.2.1,192.168.3.1"


def test_two_chip_shares() -> None:
    spec = WorkerGroupSpec(num_workers=8, topology=V6E_16, chips_per_worker=2)
    placed = _bundles(spec, chips_per_worker=2)
    for (bundle, pl), (rank, env) in zip(placed, assign_ranks(spec, placed), strict=True):
        assert rank.world_rank == (bundle // 2) * 2 + pl.tpu_chips[0] // 2
        assert rank.local_rank == pl.tpu_chips[0] // 2 and rank.local_world_size == 2
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"


def test_unaligned_share_is_a_clear_placement_error() -> None:
    spec = WorkerGroupSpec(num_workers=8, topology=V6E_16, chips_per_worker=2)
    placed = _bundles(spec, chips_per_worker=2)
    bundle, pl = placed[0]
    placed[0] = (bundle, _placement(pl.slice_name, pl.worker_id, (1, 2)))
    with pytest.raises(PlacementError, match=r"Ray assigned chips \[1, 2\].*not an aligned share"):
        assign_ranks(spec, placed)


def test_worker_on_the_wrong_host_is_refused() -> None:
    spec = WorkerGroupSpec(num_workers=16, topology=V6E_16)
    placed = _bundles(spec)
    bundle, pl = next((b, p) for b, p in placed if b == 5)  # host 1
    placed[placed.index((bundle, pl))] = (bundle, _placement("s0", 2, pl.tpu_chips))
    with pytest.raises(PlacementError, match="TPU_WORKER_ID=2, not 1"):
        assign_ranks(spec, placed)


def test_cpu_workers_group_by_node() -> None:
    spec = WorkerGroupSpec(num_workers=4)
    placed = [(b, WorkerPlacement(node_id=n, node_ip=n, pid=b)) for b, n in enumerate(["b", "a", "b", "a"])]
    ranks = [r for r, _ in assign_ranks(spec, placed)]
    assert [(r.world_rank, r.node_rank, r.local_rank, r.local_world_size) for r in ranks] == [
        (0, 0, 0, 2),
        (2, 1, 0, 2),
        (1, 0, 1, 2),
        (3, 1, 1, 2),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_workers=0), "num_workers=0"),
        (
            dict(num_workers=4, topology=SliceTopology.parse("v6e", "2x2"), chips_per_worker=3),
            "valid: 1, 2, 4",
        ),
        (dict(num_workers=3, topology=SliceTopology.parse("v6e", "2x2")), "valid: 4"),
        (dict(num_workers=2, placement_strategy="TIGHT"), "TIGHT"),
        (dict(num_workers=1, num_cpus=-1), "num_cpus=-1"),
    ],
)
def test_bad_specs(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WorkerGroupSpec(**kwargs)


class _Probe(SliceWorker):
    def all_reduce(self) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.ones(2, device="tpu") * int(__import__("os").environ["RANK"])
        dist.all_reduce(t)
        return t.cpu().tolist()

    def env(self, key: str) -> str | None:
        return __import__("os").environ.get(key)


ray.cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])  # workers can't import tests


def _free_chips() -> float:
    return ray.available_resources().get("TPU", 0)


@pytest.mark.parametrize("chips_per_worker", [1, 2])
def test_group_runs_tpu_dist_and_releases_everything(
    emulated_cluster, pg_leak_check, chips_per_worker
) -> None:
    topo = SliceTopology.parse("TPU-V6E", "2x2")
    spec = WorkerGroupSpec(
        num_workers=4 // chips_per_worker, topology=topo, chips_per_worker=chips_per_worker
    )
    with SliceWorkerGroup(spec, _Probe) as group:
        assert group.emulated and "EMULATED" in repr(group)
        ray.get(group.init_process_group("tpu_dist", timeout_s=120), timeout=300)
        world = group.world_size
        expected = float(sum(range(world)))
        assert ray.get(group.call("all_reduce"), timeout=300) == [[expected, expected]] * world
        assert ray.get(group.call("env", "LOCAL_RANK")) == [str(r) for r in range(world)]
        assert len(set(group.slice_names)) == 1
    deadline = time.monotonic() + 30
    while _free_chips() < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _free_chips() == 8  # every actor gone, every chip free again


def test_failed_reservation_leaves_nothing(emulated_cluster, pg_leak_check) -> None:
    """A 4x4 on a fixed cluster of 2x2s can never be reserved: refused at once, nothing left behind."""
    spec = WorkerGroupSpec(num_workers=16, topology=V6E_16, reserve_timeout_s=None)
    group = SliceWorkerGroup(spec, _Probe)
    with pytest.raises(ConfigError, match=r"1 x TPU-V6E 4x4 \(pod type v6e-16\) can never be reserved here"):
        group.start()
    assert group.members == []
