"""SliceClaim on the shared emulated cluster (two v6e 2x2 slices): every head in one placement group, all
or none; SlicePlacementGroups made while it is open sit on its slices."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from _util import in_thread, live_placement_groups
from tpuray import SlicePlacementGroup
from tpuray.slices import SliceClaim, SliceReservationTimeout, pending_slice_demand
from tpuray.topology import SliceTopology
from tpuray.validation import ConfigError

V6E_2X2 = SliceTopology.parse("TPU-V6E", "2x2")


def test_bad_claims_are_refused_before_anything_is_reserved() -> None:
    for shapes, timeout, match in (
        ([], 1, "at least one"),
        ([("2x2", 1)], 1, "must be a SliceTopology"),
        ([(V6E_2X2, 0)], 1, "num_slices"),
        ([(V6E_2X2, 1)], -1, "timeout_s"),
    ):
        with pytest.raises(ConfigError, match=match):
            SliceClaim(shapes, timeout_s=timeout)  # type: ignore[arg-type]


def test_a_loan_of_an_earlier_opening_changes_nothing(emulated_cluster, pg_leak_check) -> None:
    """A claim closed and opened again: a head lent by the first opening and given back afterwards does
    not free the head the second opening lent (which would lend it twice)."""
    from tpuray.slices import lending

    claim = SliceClaim([(V6E_2X2, 1)], timeout_s=60)
    try:
        old = lending.lend(V6E_2X2.pod_type, 1)
        assert old is None  # nothing open yet
        claim.open()
        old = lending.lend(V6E_2X2.pod_type, 1)
        assert old is not None
        claim.close()
        claim.open()
        new = lending.lend(V6E_2X2.pod_type, 1)
        assert new is not None and new.indices == old.indices  # the same bundle index, a new opening
        old.give_back()
        old.placed()
        assert lending.lend(V6E_2X2.pod_type, 1) is None  # still lent once, to `new`
        assert claim.is_open
        new.give_back()
        assert lending.lend(V6E_2X2.pod_type, 1) is not None
    finally:
        claim.close()


def test_claimed_slices_are_lent_then_let_go_once_all_are_reserved(emulated_cluster, pg_leak_check) -> None:
    every = {s.name for s in emulated_cluster.slices}
    claim = SliceClaim([(V6E_2X2, 1), (V6E_2X2, 1)], timeout_s=60)  # one shape: 2 slices
    spgs: list[SlicePlacementGroup] = []
    before = set(live_placement_groups())
    try:
        claim.open()
        assert claim.is_open and sorted(claim.slice_names) == sorted(every)
        held = set(live_placement_groups())
        with pytest.raises(SliceReservationTimeout, match="could not claim 1 x TPU-V6E 2x2 at once"):
            SliceClaim([(V6E_2X2, 1)], timeout_s=2).open()  # both heads are claimed
        assert set(live_placement_groups()) == held  # the failed claim holds nothing
        first = SlicePlacementGroup("2x2", "v6e", timeout_s=30)
        assert first.head_placement_groups == [] and claim.is_open  # a claimed head; one slice to go
        name = first.slice_names
        first.shutdown()  # its head goes back to the claim...
        spgs.append(SlicePlacementGroup("2x2", "v6e", timeout_s=30))
        assert spgs[0].slice_names == name  # ...and is lent again
        spgs.append(SlicePlacementGroup("2x2", "v6e", timeout_s=30))
        assert {*spgs[0].slice_names, *spgs[1].slice_names} == every
        assert not claim.is_open  # every claimed slice reserved: the claim let go of the heads
        assert set(live_placement_groups()) - before == {spg.placement_group.id.hex() for spg in spgs}
        with pytest.raises(SliceReservationTimeout):  # both slices' chips are held
            SlicePlacementGroup("2x2", "v6e", timeout_s=2)
    finally:
        for spg in spgs:
            spg.shutdown()
        claim.close()


def test_a_claim_waiting_for_two_slices_holds_neither(emulated_cluster, pg_leak_check) -> None:
    """One slice's head is held elsewhere: a claim of both waits, holding nothing meanwhile (a one-slice
    reservation takes the free slice; the pending demand is both slices), and gets both once they are
    free."""
    other = placement_group([{"TPU-v6e-4-head": 1}])  # someone else's head of one slice
    ray.get(other.ready(), timeout=30)
    claim = SliceClaim([(V6E_2X2, 2)], timeout_s=120)
    waiter, opened = in_thread(claim.open)
    try:
        for _ in range(100):  # the whole claim is pending demand, as Ray's autoscaler reads it
            if pending_slice_demand() == {"v6e-4": 2}:
                break
            time.sleep(0.1)
        assert pending_slice_demand() == {"v6e-4": 2}
        with SlicePlacementGroup("2x2", "v6e", timeout_s=30) as spg:  # the free slice: not half-claimed
            assert len(spg.slice_names) == 1 and not opened
        remove_placement_group(other)
        other = None
        waiter.join(timeout=120)
        assert opened == [claim] and len(set(claim.slice_names)) == 2
    finally:
        if other is not None:
            remove_placement_group(other)
        claim.close()
        if waiter.is_alive():
            waiter.join(timeout=120)
            claim.close()
