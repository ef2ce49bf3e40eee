"""Generation catalog: spellings, Ray naming, per-generation facts."""

from __future__ import annotations

import pytest

from tpuray.topology import GENERATIONS, get_generation, parse_topology


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("TPU-V4", "v4"),
        ("v4", "v4"),
        ("TPU-V5LITEPOD", "v5litepod"),
        ("v5litepod", "v5litepod"),
        ("TPU-V5E", "v5litepod"),
        ("v5e", "v5litepod"),
        ("tpu-v5p", "v5p"),
        ("V5P", "v5p"),
        ("TPU-V6E", "v6e"),
        ("tpu-v6e", "v6e"),
        (" v6e ", "v6e"),
        ("Trillium", "v6e"),
        ("TPU-V7X", "v7x"),
        ("tpu7x", "v7x"),
        ("v7x", "v7x"),
        ("ironwood", "v7x"),
        ("v6e-16", "v6e"),  # pod types name the generation too
        ("tpu7x-8", "v7x"),
        ("v5litepod-16", "v5litepod"),
        ("tpu-v6e-slice", "v6e"),  # GKE node labels
        ("tpu-v5-lite-podslice", "v5litepod"),
        ("tpu-v5p-slice", "v5p"),
        ("tpu-v4-podslice", "v4"),
    ],
)
def test_spellings(spelling, name):
    assert get_generation(spelling).name == name


def test_ray_facts():
    by = {g.name: g for g in GENERATIONS}
    assert set(by) == {"v4", "v5litepod", "v5p", "v6e", "v7x"}
    assert [by[n].dims for n in ("v4", "v5litepod", "v5p", "v6e", "v7x")] == [3, 2, 3, 2, 3]
    assert {n: g.cores_per_chip for n, g in by.items()} == {
        "v4": 2, "v5litepod": 1, "v5p": 2, "v6e": 1, "v7x": 2
    }  # fmt: skip
    assert {n: g.devices_per_chip for n, g in by.items()} == {
        "v4": 1, "v5litepod": 1, "v5p": 1, "v6e": 1, "v7x": 2
    }  # fmt: skip
    assert by["v6e"].accelerator_type == "TPU-V6E"
    assert by["v5litepod"].accelerator_type == "TPU-V5LITEPOD"
    assert by["v7x"].accelerator_type == "TPU-V7X"
    assert by["v5litepod"].family == "v5e" and by["v7x"].codename == "Ironwood"


def test_accelerator_type_round_trips():
    for g in GENERATIONS:
        assert get_generation(g.accelerator_type) is g
        assert get_generation(g.accelerator_type.lower()) is g
        assert get_generation(g) is g


@pytest.mark.parametrize("bad", ["TPU-V9", "v5", "gpu", "", "TPU-", "v6ee"])
def test_unknown_generation_names_value_and_valid(bad):
    with pytest.raises(ValueError) as e:
        get_generation(bad)
    assert repr(bad) in str(e.value)
    assert "TPU-V6E" in str(e.value) and "TPU-V7X" in str(e.value)


def test_non_string_generation():
    with pytest.raises(ValueError, match="must be a string"):
        get_generation(6)


@pytest.mark.parametrize(
    ("text", "dims"), [("4x4", (4, 4)), ("2x2x2", (2, 2, 2)), ("16X16", (16, 16)), (" 2x4 ", (2, 4))]
)
def test_parse_topology(text, dims):
    assert parse_topology(text) == dims


@pytest.mark.parametrize("bad", ["4", "4x", "x4", "4x4x4x4", "axb", "4*4", "0x4", "-2x2", "", "4 4"])
def test_parse_topology_malformed(bad):
    with pytest.raises(ValueError) as e:
        parse_topology(bad)
    assert repr(bad) in str(e.value)


def test_parse_topology_not_a_string():
    with pytest.raises(ValueError, match="must be a string"):
        parse_topology(None)
