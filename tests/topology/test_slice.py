"""SliceTopology: validation per generation, sizes, host grid, and layout properties (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpuray.topology import ChipPlacement, SliceTopology
from tpuray.topology.catalog import SMALL_3D_TOPOLOGIES, TOPOLOGIES_2D

# (accelerator type, topology, chips, hosts, chips/host, host_shape, host_bounds, pod type)
SIZES = [
    ("TPU-V6E", "1x1", 1, 1, 1, (1, 1, 1), (1, 1, 1), "v6e-1"),
    ("TPU-V6E", "2x2", 4, 1, 4, (2, 2, 1), (1, 1, 1), "v6e-4"),
    ("TPU-V6E", "2x4", 8, 1, 8, (2, 4, 1), (1, 1, 1), "v6e-8"),
    ("TPU-V6E", "2x8", 16, 4, 4, (2, 2, 1), (1, 4, 1), "v6e-16"),
    ("TPU-V6E", "4x4", 16, 4, 4, (2, 2, 1), (2, 2, 1), "v6e-16"),
    ("TPU-V6E", "16x16", 256, 64, 4, (2, 2, 1), (8, 8, 1), "v6e-256"),
    ("TPU-V5LITEPOD", "2x4", 8, 1, 8, (2, 4, 1), (1, 1, 1), "v5litepod-8"),
    ("TPU-V5E", "8x8", 64, 16, 4, (2, 2, 1), (4, 4, 1), "v5litepod-64"),
    ("TPU-V4", "2x2x1", 4, 1, 4, (2, 2, 1), (1, 1, 1), "v4-8"),
    ("TPU-V4", "2x2x2", 8, 2, 4, (2, 2, 1), (1, 1, 2), "v4-16"),
    ("TPU-V4", "4x4x4", 64, 16, 4, (2, 2, 1), (2, 2, 4), "v4-128"),
    ("TPU-V5P", "2x4x4", 32, 8, 4, (2, 2, 1), (1, 2, 4), "v5p-64"),
    ("TPU-V5P", "16x20x28", 8960, 2240, 4, (2, 2, 1), (8, 10, 28), "v5p-17920"),
    ("TPU-V7X", "2x2x1", 4, 1, 4, (2, 2, 1), (1, 1, 1), "v7x-8"),
    ("TPU-V7X", "16x24x24", 9216, 2304, 4, (2, 2, 1), (8, 12, 24), "v7x-18432"),
]


@pytest.mark.parametrize(("acc", "topo", "chips", "hosts", "cph", "hshape", "hbounds", "pod"), SIZES)
def test_sizes(acc, topo, chips, hosts, cph, hshape, hbounds, pod):
    t = SliceTopology.parse(acc, topo)
    assert (t.num_chips, t.num_hosts, t.chips_per_host) == (chips, hosts, cph)
    assert (t.host_shape, t.host_bounds, t.pod_type) == (hshape, hbounds, pod)
    assert t.head_resource == f"TPU-{pod}-head"
    assert t.topology == topo and len(t.shape) == 3
    assert t.num_devices == chips * t.generation.devices_per_chip


def test_contract_example():
    t = SliceTopology.parse("TPU-V6E", "4x4")
    assert t.generation.name == "v6e" and t.shape == (4, 4, 1) and t.accelerator_type == "TPU-V6E"
    assert t.layout()[5] == ChipPlacement(rank=5, host=1, local_chip=1, coords=(2, 1, 0))
    assert t == SliceTopology.parse("v6e", " 4X4 ") and hash(t) == hash(SliceTopology.parse("v6e", "4x4"))


@pytest.mark.parametrize("acc", ["v5e", "v6e"])
def test_2d_valid_and_invalid(acc):
    for topo in TOPOLOGIES_2D:
        SliceTopology.parse(acc, topo)
    for bad in ["3x3", "4x2", "1x2", "32x32", "2x2x1"]:
        with pytest.raises(ValueError) as e:
            SliceTopology.parse(acc, bad)
        msg = str(e.value)
        assert repr(bad) in msg and "valid: 1x1, 2x2, 2x4" in msg and "16x16" in msg


@pytest.mark.parametrize(("acc", "limit"), [("v4", 4096), ("v5p", 8960), ("v7x", 9216)])
def test_3d_valid_and_invalid(acc, limit):
    for topo in [*SMALL_3D_TOPOLOGIES, "4x4x4", "4x4x8", "8x4x4", "8x16x16", "12x12x24"]:
        SliceTopology.parse(acc, topo)
    for bad in ["2x2", "3x3x3", "2x2x3", "4x4x6", "1x1x1", "4x4x2", "32x32x32"]:
        with pytest.raises(ValueError) as e:
            SliceTopology.parse(acc, bad)
        assert repr(bad) in str(e.value) and "2x2x1, 2x2x2" in str(e.value)
        assert f"at most {limit} chips" in str(e.value)


def test_direct_construction_validates():
    from tpuray.topology import get_generation

    with pytest.raises(ValueError, match="'3x3' is not valid"):
        SliceTopology(get_generation("v6e"), (3, 3, 1))
    assert SliceTopology(get_generation("v6e"), (4, 4, 1)).topology == "4x4"


def test_wraparound():
    assert SliceTopology.parse("v5p", "4x4x4").wraparound == (True, True, True)
    assert SliceTopology.parse("v5p", "2x2x2").wraparound == (False, False, False)
    assert SliceTopology.parse("v6e", "16x16").wraparound == (True, True, False)
    assert SliceTopology.parse("v6e", "8x8").wraparound == (False, False, False)
    t = SliceTopology.parse("v4", "4x4x4")
    assert (3, 0, 0) in t.ici_neighbors((0, 0, 0)) and len(t.ici_neighbors((0, 0, 0))) == 6
    t = SliceTopology.parse("v6e", "2x2")
    assert t.ici_neighbors((0, 0, 0)) == [(1, 0, 0), (0, 1, 0)]


def test_out_of_range_errors():
    t = SliceTopology.parse("v6e", "2x2")
    with pytest.raises(ValueError, match="rank 4 out of range; valid: 0..3"):
        t.placement(4)
    with pytest.raises(ValueError, match="host 1 out of range; valid: 0..0"):
        t.host_coords(1)
    with pytest.raises(ValueError, match=r"coords \(2, 0, 0\) outside"):
        t.rank_of((2, 0, 0))


def _valid_3d_shapes(max_chips: int = 512) -> list[str]:
    dims = (4, 8, 12, 16)
    big = [
        "x".join(map(str, d)) for d in itertools.product(dims, repeat=3) if d[0] * d[1] * d[2] <= max_chips
    ]
    return [*SMALL_3D_TOPOLOGIES, *big]


SLICES = st.one_of(
    st.tuples(st.sampled_from(["v5e", "v6e"]), st.sampled_from(TOPOLOGIES_2D)),
    st.tuples(st.sampled_from(["v4", "v5p", "v7x"]), st.sampled_from(_valid_3d_shapes())),
).map(lambda at: SliceTopology.parse(*at))


@settings(max_examples=40, deadline=None)
@given(SLICES)
def test_layout_is_a_bijection(t):
    layout = t.layout()
    assert [p.rank for p in layout] == list(range(t.num_chips))
    every = set(itertools.product(*(range(d) for d in t.shape)))
    assert {p.coords for p in layout} == every and len(layout) == len(every)
    for p in layout:
        assert t.placement(p.rank) == p
        assert t.rank_of(p.coords) == p.rank
        assert p.host == p.rank // t.chips_per_host and p.local_chip == p.rank % t.chips_per_host


@settings(max_examples=40, deadline=None)
@given(SLICES)
def test_hosts_own_contiguous_ici_blocks(t):
    """Each host drives one host_shape box of chips, hosts are placed by host_coords, and inside a
    host every chip has an ICI neighbour on the same host."""
    hs = t.host_shape
    for host in range(t.num_hosts):
        chips = t.host_chips(host)
        origin = tuple(c * s for c, s in zip(t.host_coords(host), hs, strict=True))
        box = {tuple(o + d for o, d in zip(origin, off, strict=True))
               for off in itertools.product(*(range(s) for s in hs))}  # fmt: skip
        assert {p.coords for p in chips} == box
        if len(chips) > 1:
            mine = {p.coords for p in chips}
            assert all(any(n in mine for n in t.ici_neighbors(p.coords)) for p in chips)


@settings(max_examples=40, deadline=None)
@given(SLICES)
@example(SliceTopology.parse("v6e", "4x4"))  # always a multi-host 2D and 3D slice among the examples
@example(SliceTopology.parse("v4", "4x4x8"))
def test_neighbouring_ranks_are_ici_neighbours(t):
    """Rank r and r+1 are ICI neighbours whenever they sit on the same host row (only the fastest
    dimension changes); and hosts h, h+1 that are adjacent in the host grid hold adjacent blocks."""
    layout = t.layout()
    same_row = [
        (a, b)
        for a, b in zip(layout, layout[1:], strict=False)
        if a.host == b.host and a.coords[0] == b.coords[0] and a.coords[2] == b.coords[2]
    ]
    for a, b in same_row:
        assert t.are_ici_neighbors(a.coords, b.coords), (a, b)
    # not vacuous: every host has host_shape[0] rows of host_shape[1] chips (hosts are 2D: z is 1)
    sx, sy, sz = t.host_shape
    assert sz == 1 and len(same_row) == t.num_hosts * sx * (sy - 1), (t, len(same_row))
    adjacent = [
        h
        for h in range(t.num_hosts - 1)
        if sum(abs(x - y) for x, y in zip(t.host_coords(h), t.host_coords(h + 1), strict=True)) == 1
    ]
    for h in adjacent:
        mine = {p.coords for p in t.host_chips(h)}
        assert any(n in mine for p in t.host_chips(h + 1) for n in t.ici_neighbors(p.coords)), h
    assert adjacent or t.num_hosts == 1  # hosts 0 and 1 are always neighbours in the host grid


@settings(max_examples=40, deadline=None)
@given(SLICES)
def test_process_shares_tile_hosts(t):
    for share in t.process_shares():
        bounds = t.share_bounds(share)
        assert bounds[0] * bounds[1] * bounds[2] == share
        assert all(h % b == 0 for h, b in zip(t.host_shape, bounds, strict=True))
        # the chips of one process (consecutive local chips) form a `bounds` box
        for start in range(0, t.chips_per_host, share):
            coords = [t.layout()[start + i].coords for i in range(share)]
            spans = tuple(max(c[d] for c in coords) - min(c[d] for c in coords) + 1 for d in range(3))
            assert spans == bounds
