"""SlicePlacementGroup on the shared emulated cluster (two v6e 2x2 slices): atomic, exclusive, leak-free."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from _util import in_thread, live_placement_groups, new_placement_groups
from tpuray import SlicePlacementGroup, slice_placement_group
from tpuray.slices import SliceReservationTimeout, list_slices, placement
from tpuray.validation import ConfigError


@ray.remote(num_cpus=0)
class ChipProbe:
    def info(self) -> dict:
        from tpuray.isolation import process_env

        return {
            "node": ray.get_runtime_context().get_node_id(),
            "tpu_name": os.environ["TPU_NAME"],
            "visible": os.environ.get("TPU_VISIBLE_CHIPS"),
            "env": process_env(),
        }


def test_reserve_one_slice(emulated_cluster, pg_leak_check) -> None:
    with SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=60) as spg:
        assert ray.get(spg.placement_group.ready(), timeout=30)
        assert spg.num_hosts == 1 and spg.chips_per_host == 4 and spg.num_bundles == 1
        (name,) = spg.slice_names
        assert name in {s.name for s in emulated_cluster.slices}
        assert spg.bundle_label_selector == [{"ray.io/tpu-slice-name": name, "ray.io/tpu-worker-id": "0"}]
        assert spg.bundle_resources == {"CPU": 1.0, "TPU": 4.0}
        assert spg.topology.pod_type == "v6e-4"
        assert [s for s in list_slices() if s.name == name][0].free_chips == 0
        probe = ChipProbe.options(
            resources={"TPU": 4}, scheduling_strategy=spg.scheduling_strategy(0)
        ).remote()
        info = ray.get(probe.info.remote(), timeout=300)
        assert info["tpu_name"] == name and info["visible"] == "0,1,2,3"
        ray.kill(probe)
        # Ray's head placement groups (one per slice) claimed it; dropping them keeps the chips held
        (head,) = spg.head_placement_groups
        assert head.bundle_specs == [{"TPU-v6e-4-head": 1.0}]
        spg.release_head_pgs()
        assert spg.head_placement_groups == [] and spg.placement_group is not None
        assert [s for s in list_slices() if s.name == name][0].free_chips == 0
    assert spg.placement_group is None
    spg.shutdown()  # idempotent


def test_two_reservations_never_share_and_a_third_times_out(
    emulated_cluster, pg_leak_check, monkeypatch, caplog
) -> None:
    """A third 2x2 could come (the cluster has two; both held): it waits, saying what for, then times out.
    A fourth shape the fixed cluster has none of, or more 2x2s than it has, are refused at once."""
    a = slice_placement_group("2x2", "TPU-V6E", timeout_s=60)
    b = SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=60, name="holder-b")
    try:
        assert set(a.slice_names) | set(b.slice_names) == {s.name for s in emulated_cluster.slices}
        live = len(live_placement_groups())
        monkeypatch.setattr(placement, "PROGRESS_S", 0.5)
        with pytest.raises(SliceReservationTimeout) as err:
            SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=2)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(
            "waiting for 1 free TPU-V6E 2x2 slice(s) (pod type v6e-4;" in m and "holder-b" in m for m in said
        )
        for shape, count in (("4x4", 1), ("2x2", 3)):
            with pytest.raises(
                ConfigError, match="can never be reserved here: this Ray cluster has no autoscaler"
            ):
                SlicePlacementGroup(
                    topology=shape, accelerator_version="v6e", num_slices=count, timeout_s=None
                )
        msg = str(err.value)
        assert "v6e-4" in msg and "2x2" in msg and "released" in msg
        assert all(s.name in msg for s in emulated_cluster.slices)  # names what exists
        assert isinstance(err.value, TimeoutError)
        assert len(live_placement_groups()) <= live  # the failed attempt left nothing behind
        # Ray's head_reservation_timeout_s bounds the wait for the slice heads; timeout_s still bounds it all
        start = time.monotonic()
        with pytest.raises(SliceReservationTimeout) as err:
            SlicePlacementGroup(
                topology="2x2", accelerator_version="v6e", head_reservation_timeout_s=1, timeout_s=120
            )
        assert time.monotonic() - start < 60
        assert "within 120s" in str(err.value) and "head_reservation_timeout_s=1s" in str(err.value)
        assert len(live_placement_groups()) <= live
    finally:
        a.shutdown()
        b.shutdown()


def test_multislice_reserves_distinct_slices_in_order(emulated_cluster, pg_leak_check) -> None:
    with SlicePlacementGroup(topology="2x2", accelerator_version="v6e", num_slices=2, timeout_s=60) as spg:
        assert spg.num_slices == 2 and spg.num_bundles == 2 and spg.num_hosts == 2
        assert len(set(spg.slice_names)) == 2
        selectors = spg.bundle_label_selector
        assert [s["ray.io/tpu-slice-name"] for s in selectors] == spg.slice_names
        assert spg.bundle_index(1, 0) == 1
        (heads,) = spg.head_placement_groups  # both heads in one placement group: both or none
        assert heads.bundle_specs == [{"TPU-v6e-4-head": 1.0}] * 2


def test_multislice_waits_holding_no_slice_until_both_are_free(emulated_cluster, pg_leak_check) -> None:
    """One slice's head is held elsewhere: a 2-slice reservation waits holding neither (a 1-slice one
    takes the free slice meanwhile), and gets both once they are free."""
    from ray.util.placement_group import placement_group, remove_placement_group

    other = placement_group([{"TPU-v6e-4-head": 1}])  # someone else's head of one slice
    ray.get(other.ready(), timeout=30)
    waiter, got = in_thread(lambda: SlicePlacementGroup("2x2", "v6e", num_slices=2, timeout_s=120))
    try:
        time.sleep(1.0)  # the 2-slice reservation is waiting
        with SlicePlacementGroup("2x2", "v6e", timeout_s=30) as one:  # the free slice: not half-held
            assert len(one.slice_names) == 1 and not got
        remove_placement_group(other)
        other = None
        waiter.join(timeout=120)
        (both,) = got
        assert isinstance(both, SlicePlacementGroup) and len(set(both.slice_names)) == 2, both
        both.shutdown()
    finally:
        if other is not None:
            remove_placement_group(other)
        waiter.join(timeout=120)
        for spg in got:
            if isinstance(spg, SlicePlacementGroup):
                spg.shutdown()


def test_per_chip_bundles_and_isolation(emulated_cluster, pg_leak_check) -> None:
    with SlicePlacementGroup(
        topology="2x2", accelerator_version="v6e", resources_per_bundle={"TPU": 1}, timeout_s=60
    ) as spg:
        assert spg.num_bundles == 4
        probes = [
            ChipProbe.options(resources={"TPU": 1}, scheduling_strategy=spg.scheduling_strategy(i)).remote()
            for i in range(spg.num_bundles)
        ]
        infos = ray.get([p.info.remote() for p in probes], timeout=300)
        for p in probes:
            ray.kill(p)
    chips = sorted(i["visible"] for i in infos)
    assert chips == ["0", "1", "2", "3"]  # one chip each, never shared
    assert {i["tpu_name"] for i in infos} == set(spg.slice_names)
    ranks = sorted(int(i["env"]["CLOUD_TPU_TASK_ID"]) for i in infos)
    assert ranks == [0, 1, 2, 3]
    for i in infos:
        assert i["env"]["TPU_VISIBLE_CHIPS"] == i["visible"]
        assert i["env"]["TPU_PROCESS_PORT"] == str(8476 + int(i["visible"]))


def test_busy_hosts_time_out_and_release_everything(emulated_cluster, pg_leak_check) -> None:
    """One slice reserved, the other's chips held by a plain actor: the head PG succeeds, the hosts don't."""
    held = SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=60)
    (free,) = {s.name for s in emulated_cluster.slices} - set(held.slice_names)
    hog = ChipProbe.options(resources={"TPU": 1, free: 0.01}).remote()
    try:
        ray.get(hog.info.remote(), timeout=300)
        before, created_before = set(live_placement_groups()), set(ray.util.placement_group_table())
        # 7 s: past 2 x SETTLE_S, so the reservation checks for an idle slice while it waits; with none
        # it keeps its head and bundles instead of releasing and re-creating them (each re-creation once
        # lost the free head to the GCS's scheduling of the released one: issue 24)
        with pytest.raises(SliceReservationTimeout, match="could not be placed"):
            SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=7)
        assert len(set(ray.util.placement_group_table()) - created_before) == 2  # one head, one for the hosts
        # every placement group released (removal is an asynchronous GCS update)
        assert not new_placement_groups(before, timeout_s=10)
    finally:
        ray.kill(hog)
        held.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"topology": "3x3", "accelerator_version": "v6e"}, "3x3"),
        ({"topology": "2x2", "accelerator_version": "v99"}, "v99"),
        ({"topology": "2x2", "accelerator_version": "v6e", "num_slices": 0}, "num_slices"),
        ({"topology": "2x2", "accelerator_version": "v6e", "strategy": "EVERYWHERE"}, "EVERYWHERE"),
        ({"topology": "2x2", "accelerator_version": "v6e", "resources_per_bundle": {"TPU": 3}}, "TPU=3"),
        ({"topology": "2x2", "accelerator_version": "v6e", "timeout_s": -1}, "timeout_s"),
        ({"topology": "2x2", "accelerator_version": "v6e", "head_reservation_timeout_s": 0}, "head_res"),
        ({"topology": "2x2", "accelerator_version": "v6e", "chips_per_vm": 8}, "chips_per_vm"),
        ({"topology": "2x2", "accelerator_version": "v6e", "bundle_label_selector": [{}, {}]}, "one per"),
    ],
)
def test_bad_input_raises_before_reserving(emulated_cluster, pg_leak_check, kwargs, match) -> None:
    before = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match=match):
        SlicePlacementGroup(**kwargs)
    assert len(ray.util.placement_group_table()) == before  # nothing was even created


def test_a_slice_freed_while_waiting_is_taken(emulated_cluster, pg_leak_check) -> None:
    """Slice A's chips held by a plain placement group (its head resource free), slice B reserved: a new
    reservation's head can only land on A, where its bundles cannot be placed. Once B is released the
    reservation takes B (it looks again every SETTLE_S) instead of waiting out its timeout on A."""
    from ray.util.placement_group import placement_group, remove_placement_group

    a, b = (s.name for s in emulated_cluster.slices)
    hog = placement_group([{"TPU": 4, a: 0.01}])  # A's chips, not A's head
    ray.get(hog.ready(), timeout=120)
    held = SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=60)
    out: dict = {}

    def reserve() -> None:
        try:
            out["spg"] = SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=60)
        except BaseException as e:  # noqa: BLE001 - asserted below
            out["error"] = e

    try:
        assert held.slice_names == [b]
        thread = threading.Thread(target=reserve)
        thread.start()
        time.sleep(3)  # orders the events (its head on A first), asserts no timing
        held.shutdown()
        thread.join(120)
        assert "error" not in out, out.get("error")
        assert out["spg"].slice_names == [b]
    finally:
        if "spg" in out:
            out["spg"].shutdown()
        held.shutdown()
        remove_placement_group(hog)


def test_prefers_a_fully_free_slice(emulated_cluster, pg_leak_check) -> None:
    """A plain actor holds one chip of slice 0 (its head is free): the reservation takes slice 1."""
    busy, free = (s.name for s in emulated_cluster.slices)
    hog = ChipProbe.options(resources={"TPU": 1, busy: 0.01}).remote()
    try:
        ray.get(hog.info.remote(), timeout=300)
        with SlicePlacementGroup(topology="2x2", accelerator_version="v6e", timeout_s=60) as spg:
            assert spg.slice_names == [free]
    finally:
        ray.kill(hog)
