"""Other emulated layouts (these swap the shared cluster; conftest runs them after the default-layout tests).

The 4x4 test comes last so that later 4x4 tests (tests/train) reuse its cluster."""

from __future__ import annotations

import pytest
import ray

from tpuray import SlicePlacementGroup
from tpuray.constants import SLICE_DEMAND_ENV
from tpuray.emulator import SliceRequest
from tpuray.slices import SliceClaim, SliceReservationTimeout, list_slices
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError


@pytest.mark.full(
    "CI: emulated v5e slices brought up and reserved by the autoscaler (emulator/test_autoscale.py), every "
    "generation's labels and names (topology/, k8s/), reservations on the v6e layouts"
)
def test_two_v5e_slices(cluster_manager, pg_leak_check) -> None:
    cluster = cluster_manager.get(SliceRequest("v5e", "2x2", count=2))
    infos = list_slices()
    assert [s.name for s in infos] == [s.name for s in cluster.slices]
    assert all(s.emulated and s.pod_type == "v5litepod-4" and s.idle for s in infos)
    assert all(s.accelerator_type == "TPU-V5LITEPOD" for s in infos)
    a = SlicePlacementGroup(topology="2x2", accelerator_version="v5e", timeout_s=60)
    b = SlicePlacementGroup(topology="2x2", accelerator_version="TPU-V5LITEPOD", timeout_s=60)
    try:
        assert sorted(a.slice_names + b.slice_names) == sorted(s.name for s in cluster.slices)
        with pytest.raises(SliceReservationTimeout, match="v5litepod-4"):
            SlicePlacementGroup(topology="2x2", accelerator_version="v5e", timeout_s=2)
        # no v6e slice here at all, and no autoscaler to bring one: refused at once, naming what there is
        with pytest.raises(ConfigError, match=r"TPU-V6E 2x2 \(pod type v6e-4\) can never be reserved") as err:
            SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=None)
        assert "its TPU slices are 2 x TPU-V5LITEPOD 2x2 (v5litepod-4)" in str(err.value)
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.slow
def test_v6e_4x4_four_hosts(cluster_manager, pg_leak_check, monkeypatch) -> None:
    cluster = cluster_manager.get(SliceRequest("TPU-V6E", "4x4"))
    (sl,) = cluster.slices
    assert len(sl.node_ids) == 4
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    for worker_id, node_id in enumerate(sl.node_ids):
        labels, res = nodes[node_id]["Labels"], nodes[node_id]["Resources"]
        assert labels["ray.io/tpu-worker-id"] == str(worker_id)
        assert labels["ray.io/tpu-pod-type"] == "v6e-16" and labels["ray.io/tpu-topology"] == "4x4"
        assert res["TPU"] == 4 and res[sl.name] == 1
        assert ("TPU-v6e-16-head" in res) == (worker_id == 0)

    # Ray 2.60's own SlicePlacementGroup reserves the emulated multi-host slice.
    from ray.util.tpu import SlicePlacementGroup as RaySlicePlacementGroup

    ray_spg = RaySlicePlacementGroup(topology="4x4", accelerator_version="v6e")
    try:
        assert ray.get(ray_spg.placement_group.ready(), timeout=60)
        assert ray_spg.bundle_label_selector == [{"ray.io/tpu-slice-name": sl.name}] * 4
    finally:
        ray_spg.shutdown()

    with SlicePlacementGroup(topology="4x4", accelerator_version="v6e", timeout_s=60) as spg:
        assert spg.num_hosts == 4 and spg.slice_names == [sl.name]
        table = ray.util.placement_group_table(spg.placement_group)["bundles_to_node_id"]
        assert [table[i] for i in range(4)] == sl.node_ids  # bundles ordered by worker id

    # "whole" demand (Ray's v2 autoscaler, tpuray.slices.demand): the head and a companion on each other
    # host of the slice, strictly spread, then the hosts' bundles as before
    monkeypatch.setenv(SLICE_DEMAND_ENV, "whole")
    with SlicePlacementGroup(topology="4x4", accelerator_version="v6e", timeout_s=60) as spg:
        (heads,) = spg.head_placement_groups
        assert heads.bundle_specs == [{"TPU-v6e-16-head": 1.0}] + [{"memory": 1.0}] * 3
        placed = ray.util.placement_group_table(heads)
        assert placed["strategy"] == "STRICT_SPREAD" and placed["bundles_to_node_id"][0] == sl.node_ids[0]
        assert sorted(placed["bundles_to_node_id"].values()) == sorted(sl.node_ids)
        table = ray.util.placement_group_table(spg.placement_group)["bundles_to_node_id"]
        assert spg.slice_names == [sl.name] and [table[i] for i in range(4)] == sl.node_ids
    # a SliceClaim asks the same way (its heads first, then the companions); a reservation borrows the
    # claimed head, and once it holds the slice the claim lets go of its placement group
    claim = SliceClaim([(SliceTopology.parse("TPU-V6E", "4x4"), 1)], timeout_s=60).open()
    try:
        assert claim.slice_names == [sl.name]
        with SlicePlacementGroup(topology="4x4", accelerator_version="v6e", timeout_s=60) as spg:
            assert spg.head_placement_groups == [] and spg.slice_names == [sl.name] and not claim.is_open
    finally:
        claim.close()
    # each of the 16 chips' environment on this slice: tests/train/test_data.py's 4x4 fit (16 workers)
