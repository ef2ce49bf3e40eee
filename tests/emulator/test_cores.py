"""EmulatedCluster(cores="per_slice"): each slice's hosts, and the workers their raylets start, compute on
cores of their own (as a real slice on its own chips); refused where it cannot be honoured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tpuray.emulator import EmulatedCluster, SliceRequest
from tpuray.emulator.hosts import _on_cores
from tpuray.emulator.spec import split_cores
from tpuray.validation import ConfigError

USABLE = sorted(os.sched_getaffinity(0))


def test_split_cores_gives_each_slice_as_many_cores_of_its_own() -> None:
    assert split_cores(2, [3, 1, 0, 2]) == [(0, 1), (2, 3)]
    assert split_cores(3, range(4)) == [(0,), (1,), (2,)]  # the fourth serves the head alone
    assert split_cores(1, [5, 7]) == [(5, 7)]
    with pytest.raises(ConfigError, match=re.escape("each of the 3 slices cores of its own; this process")):
        split_cores(3, [0, 1])


def test_bad_cores_are_refused_before_starting() -> None:
    one = [SliceRequest("TPU-V6E", "2x2")]
    with pytest.raises(
        ConfigError, match=re.escape("cores='pinned' is not valid; valid: 'shared', 'per_slice'")
    ):
        EmulatedCluster(one, cores="pinned")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Ray's autoscaler starts its slices itself"):
        EmulatedCluster([], autoscale=True, max_slices={("TPU-V6E", "2x2"): 1}, cores="per_slice")
    too_many = [SliceRequest("TPU-V6E", "2x2", count=len(USABLE) + 1)]
    with pytest.raises(ConfigError, match=f"start at most {len(USABLE)} slice"):
        EmulatedCluster(too_many, cores="per_slice")
    planned = EmulatedCluster(one, cores="per_slice")
    assert planned.slices[0].cores == tuple(USABLE) and "cores of its own" in planned.describe()
    assert EmulatedCluster(one).slices[0].cores == ()  # shared: every core


_DRIVER = """
import json, os, sys, ray
from tpuray.emulator import EmulatedCluster, SliceRequest

@ray.remote(num_cpus=0)
def cores():
    return sorted(os.sched_getaffinity(0))

def on(name):
    return ray.get(cores.options(resources={name: 0.01}).remote())

with EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=2)], head_cpus=1, cores="per_slice") as c:
    c.connect()
    out = {"planned": {s.name: list(s.cores) for s in c.slices}}
    out["workers"] = {s.name: on(s.name) for s in c.slices}
    out["driver"] = sorted(os.sched_getaffinity(0))
    from tpuray.slices import format_slices, list_slices
    out["status"] = format_slices(list_slices())
    last = c.slices[1]
    c.restore_host(c.kill_host(last.node_ids[0]))  # a replacement host keeps its slice's cores
    out["restored"] = on(last.name)
    ray.shutdown()
print(json.dumps(out))
"""


@pytest.mark.skipif(len(USABLE) < 2, reason="two disjoint sets need two cores")
def test_a_process_started_on_cores_keeps_them_and_the_starter_keeps_its_own() -> None:
    """The mechanism a host start relies on: a process this thread starts inside `_on_cores` runs on those
    cores alone (as a raylet does, and the workers it starts); the thread's own cores come back after."""
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with _on_cores((USABLE[-1],)):
        pinned = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert json.loads(pinned) == [USABLE[-1]]
    assert sorted(os.sched_getaffinity(0)) == USABLE
    with _on_cores(()):  # (): shared, nothing changes
        assert json.loads(subprocess.run(probe, capture_output=True, text=True, check=True).stdout) == USABLE


@pytest.mark.full(
    "CI: the split and every refusal (this module, test_cli.py) and a process started on a slice's cores "
    "(test_a_process_started_on_cores_keeps_them...); here: a real two-slice cluster's workers"
)
@pytest.mark.skipif(len(USABLE) < 2, reason="cores='per_slice' with two slices needs two cores")
def test_per_slice_cores_pin_each_slice_its_workers_and_a_restored_host() -> None:
    run = subprocess.run([sys.executable, "-c", _DRIVER], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    planned = out["planned"]
    assert list(planned.values()) == [list(c) for c in split_cores(2, USABLE)]
    assert out["workers"] == planned  # the raylet's workers inherit its slice's cores
    assert out["restored"] == planned["emulated-v6e-4-1"]
    assert out["driver"] == USABLE  # the driver (and the head) keep every core
    for name, cores in planned.items():  # labelled: `tpuray status` shows them
        (row,) = [line for line in out["status"].splitlines() if line.startswith(name)]
        assert row.endswith(f"EMULATED (cores {','.join(map(str, cores))})"), out["status"]
