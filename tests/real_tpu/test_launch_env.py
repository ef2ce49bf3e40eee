"""On a TPU VM: torch_tpu's real launcher, `set_tpu_launch_env()`, against tpuray's env for each shape.

For every shape, one child process imports torch_tpu and, for every host of the shape, gives
`set_tpu_launch_env()` the host env tpuray sets there (TPU_WORKER_HOSTNAMES, TORCH_TPU_TOPOLOGY,
TORCH_TPU_DEVICES_PER_HOST) and that host's chip coordinates. Only the chip-coordinate query is replaced
(it asks the one real chip otherwise); torch_tpu reads some variables once per process (C++
GetEnvOnce), hence one child per shape. No Ray, no TCP, the chip is never opened. Needs only
`tpuray.topology` on PYTHONPATH (no Ray, no tpuray install). Run on the VM:

    PYTHONPATH=<torch_tpu paths>:$PWD/src python3 -m pytest -q --confcutdir=tests/real_tpu \
        -p no:cacheprovider tests/real_tpu/test_launch_env.py
    # or without pytest:  python3 tests/real_tpu/test_launch_env.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

OUT_PREFIX = "TPURAY_LAUNCH_ENV="
# (accelerator, topology) of the multi-host shapes checked; tpuray's hostnames are h0, h1, ...
SHAPES = [
    ("TPU-V6E", "4x4"),
    ("TPU-V6E", "4x8"),
    ("TPU-V4", "2x2x2"),
    ("TPU-V4", "2x4x4"),
    ("TPU-V7X", "2x2x2"),
]
SHAPES += [("TPU-V7X", "2x4x4")]
# What set_tpu_launch_env writes (and the test clears between hosts).
DERIVED = ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
# Host env of the VM that would leak into torch_tpu's launcher.
CLEARED = (*DERIVED, "TPU_WORKER_HOSTNAMES", "JOB_COMPLETION_INDEX", "TORCH_TPU_TOPOLOGY")
CLEARED += ("TORCH_TPU_DEVICES_PER_HOST", "TORCH_TPU_BASE_PORT")


def _have_torch_tpu() -> bool:
    return importlib.util.find_spec("torch_tpu") is not None  # finds it without importing torch


def _expected(accel: str, shape: str) -> dict[str, Any]:
    """tpuray's side: per host, the launcher's inputs, the chip coordinates and what it must derive."""
    from tpuray.topology import SliceTopology
    from tpuray.topology.launch import host_chip_coords, launcher_inputs, launcher_outputs

    topo = SliceTopology.parse(accel, shape)
    names = [f"h{w}" for w in range(topo.num_hosts)]
    hosts = range(topo.num_hosts)
    return {
        "inputs": launcher_inputs(topo, 0, names),
        "coords": [list(host_chip_coords(topo, w)) for w in hosts],
        "outputs": [launcher_outputs(topo, w, names) for w in hosts],
    }


def _run_child(case: dict[str, Any]) -> list[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(case["inputs"])
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case["coords"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(OUT_PREFIX)]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1].removeprefix(OUT_PREFIX))


def _child(coords: list[list[int]]) -> None:
    """In a fresh process: the real set_tpu_launch_env once per host, with that host's chip coordinates."""
    from torch_tpu._internal import env_utils
    from torch_tpu._internal.distributed import distributed as tdd

    out = []
    for xyz in coords:
        for k in DERIVED:
            os.environ.pop(k, None)
        env_utils._resolved_values.clear()  # its per-process memo of derived values
        tdd._query_local_device_coords = lambda xyz=xyz: list(xyz)  # this host's chip, not the VM's
        tdd.set_tpu_launch_env()
        out.append({k: os.environ[k] for k in DERIVED})
    print(OUT_PREFIX + json.dumps(out), flush=True)


def _compare(accel: str, shape: str) -> list[str]:
    case = _expected(accel, shape)
    got = _run_child(case)
    diffs = []
    for host, (want, have) in enumerate(zip(case["outputs"], got, strict=True)):
        for k, v in want.items():
            if have.get(k) != v:
                diffs.append(f"{accel} {shape} host {host}: {k}: torch_tpu {have.get(k)!r}, tpuray {v!r}")
    return diffs


@pytest.mark.real_tpu
@pytest.mark.parametrize(("accel", "shape"), SHAPES, ids=[f"{a}-{s}" for a, s in SHAPES])
def test_set_tpu_launch_env_agrees_with_tpuray(accel: str, shape: str) -> None:
    if not _have_torch_tpu():
        pytest.skip("torch_tpu is not importable here (run on a TPU VM with torch_tpu 0.2.0)")
    assert _compare(accel, shape) == []


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        _child(json.loads(sys.argv[2]))
        return 0
    if not _have_torch_tpu():
        print("torch_tpu is not importable here")
        return 2
    diffs = [d for accel, shape in SHAPES for d in _compare(accel, shape)]
    print("\n".join(diffs) or f"torch_tpu's set_tpu_launch_env agrees with tpuray on {len(SHAPES)} shapes")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
