"""Per-process environment (worker_env / worker_envs)."""

from __future__ import annotations

import pytest

from tpuray.topology import (
    SliceTopology,
    default_hostnames,
    multislice_env,
    num_processes,
    worker_env,
    worker_envs,
)

V6E_2X2 = SliceTopology.parse("TPU-V6E", "2x2")
V6E_4X4 = SliceTopology.parse("TPU-V6E", "4x4")
V6E_2X4 = SliceTopology.parse("TPU-V6E", "2x4")


@pytest.mark.parametrize("r", range(4))
def test_single_host_2x2_matches_torch_xla(r):
    env = worker_env(V6E_2X2, r)
    assert env == {
        "TPU_VISIBLE_CHIPS": str(r),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479",
        "TPU_PROCESS_PORT": str(8476 + r),
        "CLOUD_TPU_TASK_ID": str(r),
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_ACCELERATOR_TYPE": "v6e-4",
        "TPU_TOPOLOGY": "2x2",
        "TORCH_TPU_TOPOLOGY": "2,2,1",
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": "localhost:8070,localhost:8071,localhost:8072,localhost:8073",
        "TORCH_TPU_DEVICES_PER_HOST": "4",
    }


def test_multi_host_4x4():
    hosts = ["h0", "h1", "h2", "h3"]
    envs = worker_envs(V6E_4X4, hosts)
    assert len(envs) == 16
    for r, env in enumerate(envs):
        assert env == worker_env(V6E_4X4, r, hosts)
        p = V6E_4X4.layout()[r]
        assert env["TPU_WORKER_ID"] == str(p.host) and env["TPU_VISIBLE_CHIPS"] == str(p.local_chip)
        assert env["CLOUD_TPU_TASK_ID"] == str(r) and env["TPU_PROCESS_PORT"] == str(8476 + p.local_chip)
    env = envs[6]
    assert env["TPU_PROCESS_BOUNDS"] == "4,4,1"  # host bounds 2,2,1 x per-host 2,2,1
    assert env["TPU_WORKER_HOSTNAMES"] == "h0,h1,h2,h3"
    assert env["TPU_PROCESS_ADDRESSES"].split(",")[:5] == [
        "h0:8476", "h0:8477", "h0:8478", "h0:8479", "h1:8476"
    ]  # fmt: skip
    assert len(env["TPU_PROCESS_ADDRESSES"].split(",")) == 16
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[4:6] == ["h1:8070", "h1:8071"]
    assert env["TPU_ACCELERATOR_TYPE"] == "v6e-16" and env["TORCH_TPU_TOPOLOGY"] == "4,4,1"


def test_default_hostnames():
    assert default_hostnames(V6E_2X2) == ["localhost"]
    assert default_hostnames(V6E_4X4) == ["v6e-16-w0", "v6e-16-w1", "v6e-16-w2", "v6e-16-w3"]
    assert worker_env(V6E_4X4, 0, "a,b,c,d")["TPU_WORKER_HOSTNAMES"] == "a,b,c,d"


@pytest.mark.parametrize(
    ("topo", "share", "bounds", "process_bounds", "visible"),
    [
        (V6E_2X2, 2, "1,2,1", "2,1,1", ["0,1", "2,3"]),
        (V6E_2X2, 4, "2,2,1", "1,1,1", ["0,1,2,3"]),
        (V6E_2X4, 2, "1,2,1", "2,2,1", ["0,1", "2,3", "4,5", "6,7"]),
        (V6E_2X4, 4, "1,4,1", "2,1,1", ["0,1,2,3", "4,5,6,7"]),
        (V6E_2X4, 8, "2,4,1", "1,1,1", ["0,1,2,3,4,5,6,7"]),
        (V6E_4X4, 2, "1,2,1", "4,2,1", ["0,1", "2,3"] * 4),
        (V6E_4X4, 4, "2,2,1", "2,2,1", ["0,1,2,3"] * 4),
    ],
)
def test_chip_shares(topo, share, bounds, process_bounds, visible):
    envs = worker_envs(topo, chips_per_process=share)
    assert len(envs) == num_processes(topo, share) == topo.num_chips // share
    assert [e["TPU_VISIBLE_CHIPS"] for e in envs] == visible
    procs_per_host = topo.chips_per_host // share
    for r, e in enumerate(envs):
        assert e["TPU_CHIPS_PER_PROCESS_BOUNDS"] == bounds
        assert e["TPU_PROCESS_BOUNDS"] == process_bounds
        assert e["CLOUD_TPU_TASK_ID"] == str(r)
        assert e["TPU_WORKER_ID"] == str(r // procs_per_host)
        assert e["TPU_PROCESS_PORT"] == str(8476 + r % procs_per_host)
        assert len(e["TPU_PROCESS_ADDRESSES"].split(",")) == len(envs)
        assert len(e["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == len(envs)


@pytest.mark.parametrize(
    ("topo", "share", "valid"),
    [(V6E_4X4, 8, "1, 2, 4"), (V6E_2X2, 3, "1, 2, 4"), (V6E_2X4, 16, "1, 2, 4, 8"),
     (SliceTopology.parse("v6e", "1x1"), 2, "1"), (V6E_2X2, 2.0, "1, 2, 4"), (V6E_2X2, True, "1, 2, 4")],
)  # fmt: skip
def test_share_that_does_not_tile_a_host(topo, share, valid):
    with pytest.raises(ValueError) as e:
        worker_env(topo, 0, chips_per_process=share)
    assert f"chips_per_process={share!r}" in str(e.value) and str(e.value).endswith(f"valid: {valid}")


def test_v7x_two_devices_per_chip():
    t = SliceTopology.parse("TPU-V7X", "2x2x2")
    env = worker_env(t, 5)
    assert env["TPU_ACCELERATOR_TYPE"] == "v7x-16"
    assert env["TORCH_TPU_TOPOLOGY"] == "2,2,2,2"
    assert env["TPU_PROCESS_BOUNDS"] == "2,2,2,2"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    # ranks per host (one process per chip), so torch_tpu's launcher derives the same 4 addresses per host
    assert env["TORCH_TPU_DEVICES_PER_HOST"] == "4"
    assert env["TPU_WORKER_ID"] == "1" and env["TPU_VISIBLE_CHIPS"] == "1"


def test_3d_multi_host():
    t = SliceTopology.parse("v4", "2x2x4")
    env = worker_env(t, 13)
    assert env["TPU_PROCESS_BOUNDS"] == "2,2,4" and env["TPU_ACCELERATOR_TYPE"] == "v4-32"
    assert env["TPU_WORKER_ID"] == "3" and env["TPU_VISIBLE_CHIPS"] == "1"


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"rank 16 out of range .* valid: 0\.\.15"):
        worker_env(V6E_4X4, 16)
    with pytest.raises(ValueError, match=r"rank 2 out of range .* valid: 0\.\.1"):
        worker_env(V6E_2X2, 2, chips_per_process=2)
    with pytest.raises(ValueError, match="hostnames must list 4"):
        worker_env(V6E_4X4, 0, ["a", "b"])
    with pytest.raises(ValueError, match="port_base=70000"):
        worker_env(V6E_2X2, 0, port_base=70000)


def test_custom_ports():
    env = worker_env(V6E_2X2, 1, port_base=9000, slicebuilder_port_base=7000)
    assert env["TPU_PROCESS_PORT"] == "9001"
    assert env["TPU_PROCESS_ADDRESSES"].startswith("localhost:9000,localhost:9001")
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].startswith("localhost:7000,")


def test_multislice_env():
    assert multislice_env("h0", 2, 1) == {
        "MEGASCALE_COORDINATOR_ADDRESS": "h0",
        "MEGASCALE_PORT": "8081",
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
    }
    with pytest.raises(ValueError, match="slice_id=2 out of range; valid: 0..1"):
        multislice_env("h0", 2, 2)
