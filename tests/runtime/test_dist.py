"""tpu_dist across 2 processes on the emulated device: every collective, then DDP / DTensor / FSDP2.

One spawn runs all checks in order (process startup dominates); each rank asserts its own results and
prints "<check> OK rank N" after each group of checks.
"""

from __future__ import annotations

import re

import pytest

from _util import free_port
from conftest import HERE, run_python

CHECKS = ["collectives", "training", "plain_ddp", "prepare_model"]


DDP_TIME_STATS = "Time stats are currently only collected for CPU and CUDA devices"


def _run_checks(checks: list[str]):
    return run_python(args=[str(HERE / "_dist_checks.py"), ",".join(checks), "2", str(free_port())])


@pytest.fixture(scope="module")
def proc():
    return _run_checks(CHECKS)


@pytest.fixture(scope="module")
def output(proc) -> str:
    return proc.stdout


def test_collectives(output):
    """all_reduce (SUM/PRODUCT/MIN/MAX/AVG, int64, async future), broadcast, all_gather(+_into_tensor),
    reduce_scatter(+_tensor, AVG), all_to_all(+_single), barrier, send/recv; a host tensor refused
    ("No backend type associated with device type cpu", TorchTPU's words)."""
    assert sorted(re.findall(r"collectives OK rank (\d)", output)) == ["0", "1"]


def test_ddp_dtensor_fsdp2(output):
    """DDP (with and without gradient_as_bucket_view, and under torch.compile), DTensor, FSDP2:
    gradients equal a float64 CPU reference and are identical across ranks."""
    assert sorted(re.findall(r"training OK rank (\d)", output)) == ["0", "1"]


def test_ddp_is_quiet_on_the_emulated_device(proc):
    """No DDP on the emulated device prints c10d's time-stats warning (no timer for the tpu device):
    plain DDP, compiled DDP (training) and prepare_model's. The control process samples c10d's own
    logger and prints it once per process, so the check can fail."""
    for check in ("plain_ddp", "prepare_model"):
        assert sorted(re.findall(rf"{check} OK rank (\d)", proc.stdout)) == ["0", "1"]
    assert DDP_TIME_STATS not in proc.stderr
    control = _run_checks(["c10d_time_stats"])
    assert sorted(re.findall(r"c10d_time_stats OK rank (\d)", control.stdout)) == ["0", "1"]
    assert control.stderr.count(DDP_TIME_STATS) == 2
