"""tpuray's per-process env against torch_tpu 0.2.0's own launcher, `set_tpu_launch_env()`.

The facts in TABLE and below were read from torch_tpu 0.2.0 (PyPI wheel torch_tpu-0.2.0-cp311, file
`torch_tpu/_internal/distributed/distributed.py`: `set_tpu_launch_env`, `_parse_topology`,
`_get_slice_host_coordinates`, `_calculate_topological_node_rank`, `_CHIPS_PER_HOST`; and
`torch_tpu/_internal/utils/hardware.py`: the per-generation device-count -> topology maps). Importing
torch_tpu needs libtpu (and on a CPU machine aborts the process), so here the rules are a table.
`test_table_matches_torch_tpu_source` executes torch_tpu's own pure helpers when its source can be
found without importing it (installed, or TPURAY_TORCH_TPU_SRC = the unpacked wheel);
tests/real_tpu/test_launch_env.py runs the real `set_tpu_launch_env` on a TPU VM. No Ray here.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from tpuray.constants import (
    CLOUD_TPU_TASK_ID_ENV,
    MASTER_ADDR_ENV,
    NNODES_ENV,
    NODE_RANK_ENV,
    TORCH_TPU_DEVICES_PER_HOST_ENV,
    TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV,
    TORCH_TPU_TOPOLOGY_ENV,
    TPU_PROCESS_ADDRESSES_ENV,
    TPU_VISIBLE_CHIPS_ENV,
)
from tpuray.topology import DEFAULT_SLICEBUILDER_PORT, SliceTopology
from tpuray.topology.launch import host_envs, launcher_inputs, launcher_outputs

# -- read from torch_tpu 0.2.0, torch_tpu/_internal/distributed/distributed.py ----------------------------
CHIPS_PER_HOST = (2, 2, 1)  # _CHIPS_PER_HOST: the host block NODE_RANK assumes on every multi-host slice
BASE_PORT = 8070  # set_tpu_launch_env: TORCH_TPU_BASE_PORT's default; address i of a host is base + i
# Multi-host (>1 TPU_WORKER_HOSTNAMES or JOB_COMPLETION_INDEX set): addresses are f"{host}:{base + i}" for
# host in TPU_WORKER_HOSTNAMES order, i < TORCH_TPU_DEVICES_PER_HOST; NNODES = len(hostnames);
# MASTER_ADDR = hostnames[0]; MASTER_PORT = "29500"; a TORCH_TPU_TOPOLOGY set from outside is kept.
# NODE_RANK = index of (chip coords // _CHIPS_PER_HOST) in the host grid sorted by (z, y, x)
# (`_get_slice_host_coordinates`: Z-major, X-minor), grid = first 3 dims of TORCH_TPU_TOPOLOGY // (2,2,1).
# Single host (one hostname, no JOB_COMPLETION_INDEX): addresses are localhost:<unused port>, one per
# process; TORCH_TPU_TOPOLOGY from hardware.py's map for the device count (v5e 4 -> "2,2,1", v6e 8 ->
# "2,4,1", v4 4 -> "2,2,1", v7 8 devices -> "2,2,1,2").

# (accelerator, topology, TORCH_TPU_TOPOLOGY, hosts sorted as torch_tpu ranks them: NODE_RANK n is hosts[n])
MULTI_HOST = [
    ("TPU-V6E", "4x4", "4,4,1", [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]),
    ("TPU-V6E", "4x8", "4,8,1", [(x, y, 0) for y in range(4) for x in range(2)]),
    ("TPU-V4", "2x2x2", "2,2,2", [(0, 0, 0), (0, 0, 1)]),
    ("TPU-V4", "2x4x4", "2,4,4", [(0, y, z) for z in range(4) for y in range(2)]),
    ("TPU-V7X", "2x2x2", "2,2,2,2", [(0, 0, 0), (0, 0, 1)]),
    ("TPU-V7X", "2x4x4", "2,4,4,2", [(0, y, z) for z in range(4) for y in range(2)]),
]
# (accelerator, topology, TORCH_TPU_TOPOLOGY from hardware.py for the host's device count)
SINGLE_HOST = [
    ("TPU-V5LITEPOD", "2x2", "2,2,1"),
    ("TPU-V6E", "2x4", "2,4,1"),
    ("TPU-V4", "2x2x1", "2,2,1"),
    ("TPU-V7X", "2x2x1", "2,2,1,2"),
]


def _torch_tpu_node_rank(chip: tuple[int, int, int], hosts: list[tuple[int, int, int]]) -> int:
    return hosts.index(tuple(c // s for c, s in zip(chip, CHIPS_PER_HOST, strict=True)))


def _ids(cases: list[Any]) -> list[str]:
    return [f"{c[0]}-{c[1]}" for c in cases]


@pytest.mark.parametrize("share", [1, 2, 4])
@pytest.mark.parametrize(("accel", "shape", "torch_topology", "hosts"), MULTI_HOST, ids=_ids(MULTI_HOST))
def test_multi_host_env_is_what_torch_tpu_derives(accel, shape, torch_topology, hosts, share) -> None:
    topo = SliceTopology.parse(accel, shape)
    names = [f"h{w}" for w in range(topo.num_hosts)]
    assert len(hosts) == topo.num_hosts
    for w in range(topo.num_hosts):
        given, envs = launcher_inputs(topo, w, names, share), host_envs(topo, w, names, share)
        assert given[TORCH_TPU_TOPOLOGY_ENV] == torch_topology
        per_host = int(given[TORCH_TPU_DEVICES_PER_HOST_ENV])
        assert per_host == len(envs) == topo.chips_per_host // share  # LOCAL_RANK < it, one address each
        derived = ",".join(f"{h}:{BASE_PORT + i}" for h in names for i in range(per_host))
        node_rank = _torch_tpu_node_rank(topo.host_chips(w)[0].coords, hosts)
        # every chip of the host is in the same torch_tpu host block
        assert {_torch_tpu_node_rank(p.coords, hosts) for p in topo.host_chips(w)} == {node_rank}
        assert launcher_outputs(topo, w, names, share) == {
            TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV: derived,
            NNODES_ENV: str(len(names)),
            NODE_RANK_ENV: str(node_rank),
            MASTER_ADDR_ENV: names[0],
        }
        # world ranks: torch_tpu/torchrun's NODE_RANK * nproc_per_node + LOCAL_RANK, and the address of rank r
        # in the slice-builder list is on this host
        for local, env in enumerate(envs):
            rank = int(env[CLOUD_TPU_TASK_ID_ENV])
            assert rank == node_rank * per_host + local
            assert env[TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV].split(",")[rank] == f"h{w}:{BASE_PORT + local}"
            assert env[TPU_PROCESS_ADDRESSES_ENV].split(",")[rank].startswith(f"h{w}:")


@pytest.mark.parametrize(("accel", "shape", "torch_topology"), SINGLE_HOST, ids=_ids(SINGLE_HOST))
def test_single_host_env_is_what_torch_tpu_derives(accel, shape, torch_topology) -> None:
    topo = SliceTopology.parse(accel, shape)
    envs = host_envs(topo, 0)
    assert launcher_inputs(topo, 0)[TORCH_TPU_TOPOLOGY_ENV] == torch_topology
    for env in envs:
        addresses = env[TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV].split(",")
        # torch_tpu: one localhost address per process (its ports are picked free; tpuray's are 8070 + i)
        assert [a.split(":")[0] for a in addresses] == ["localhost"] * len(envs)
    assert launcher_outputs(topo, 0)[NODE_RANK_ENV] == "0"  # torch_tpu's _print_launch_env default


def test_v5e_2x2_is_torch_xla_and_torch_tpu_single_host_layout() -> None:
    envs = host_envs(SliceTopology.parse("v5e", "2x2"), 0)
    assert [e[TPU_VISIBLE_CHIPS_ENV] for e in envs] == ["0", "1", "2", "3"]
    assert {e[TORCH_TPU_DEVICES_PER_HOST_ENV] for e in envs} == {"4"}
    assert envs[0][TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV] == ",".join(
        f"localhost:{8070 + i}" for i in range(4)
    )


def test_base_port_is_torch_tpus() -> None:
    assert DEFAULT_SLICEBUILDER_PORT == BASE_PORT


# -- torch_tpu's own code, where its source is on this machine --------------------------------------------
SOURCE_ENV = "TPURAY_TORCH_TPU_SRC"  # test-only: an unpacked torch_tpu wheel (folder holding torch_tpu/)
_HELPERS = ("_parse_topology", "_get_slice_host_coordinates", "_calculate_topological_node_rank")


def _torch_tpu_source() -> Path | None:
    root = os.environ.get(SOURCE_ENV)
    if root:
        return Path(root) / "torch_tpu" / "_internal" / "distributed" / "distributed.py"
    spec = importlib.util.find_spec("torch_tpu")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "_internal" / "distributed" / "distributed.py"


def _load_helpers(path: Path) -> dict[str, Any]:
    """torch_tpu's pure topology helpers and constants, executed from its source (nothing stubbed)."""
    tree = ast.parse(path.read_text())
    keep: list[ast.stmt] = list(ast.parse("import re\nfrom collections.abc import Sequence").body)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in _HELPERS:
            keep.append(node)
        elif isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_CHIPS_PER_HOST":
            keep.append(node)
    ns: dict[str, Any] = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)
    ns["_base_port"] = next(
        kw.value.value  # type: ignore[attr-defined]
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and any(getattr(a, "value", None) == "TORCH_TPU_BASE_PORT" for a in n.args)
        for kw in n.keywords
        if kw.arg == "default_value"
    )
    return ns


def test_table_matches_torch_tpu_source() -> None:
    path = _torch_tpu_source()
    if path is None or not path.is_file():
        pytest.skip(f"torch_tpu's source not found (install torch_tpu 0.2.0 or set {SOURCE_ENV})")
    tt = _load_helpers(path)
    assert tt["_CHIPS_PER_HOST"] == CHIPS_PER_HOST and tt["_base_port"] == BASE_PORT
    for accel, shape, torch_topology, hosts in MULTI_HOST:
        assert tt["_get_slice_host_coordinates"](torch_topology) == hosts
        topo = SliceTopology.parse(accel, shape)
        for p in topo.layout():
            rank = tt["_calculate_topological_node_rank"](list(p.coords), torch_topology)
            assert rank == p.host, (accel, shape, p)
