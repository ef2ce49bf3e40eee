"""tpu_dist across 2 processes on the emulated device: every collective, then DDP / DTensor / FSDP2.

One spawn runs all checks in order (process startup dominates); each rank asserts its own results and
prints "<check> OK rank N" after each group of checks.
"""

from __future__ import annotations

import re

import pytest

from conftest import HERE, free_port, run_python

CHECKS = ["collectives", "training"]


@pytest.fixture(scope="module")
def output() -> str:
    return run_python(args=[str(HERE / "_dist_checks.py"), ",".join(CHECKS), "2", str(free_port())]).stdout


def test_collectives(output):
    """all_reduce (SUM/PRODUCT/MIN/MAX/AVG, int64, async future), broadcast, all_gather(+_into_tensor),
    reduce_scatter(+_tensor, AVG), all_to_all(+_single), barrier, send/recv."""
    assert sorted(re.findall(r"collectives OK rank (\d)", output)) == ["0", "1"]


def test_ddp_dtensor_fsdp2(output):
    """DDP (with and without gradient_as_bucket_view, and under torch.compile), DTensor, FSDP2:
    gradients equal a float64 CPU reference and are identical across ranks."""
    assert sorted(re.findall(r"training OK rank (\d)", output)) == ["0", "1"]
