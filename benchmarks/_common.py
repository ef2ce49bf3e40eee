"""Helpers the benchmark scripts share (each script runs on its own: `python benchmarks/bench_x.py`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_call(
    call: Callable[..., Any], inputs: Callable[[int], tuple], calls: int, warmup: int = 3
) -> tuple[Any, dict[str, float]]:
    """Time `call(*inputs(i))` for `warmup + calls` calls, each input made before its call's clock starts
    (`call` must wait for its result, e.g. by reading it back): the last result, and the first call's
    seconds with the median and best milliseconds of the calls after the warm-up."""
    times, out = [], None
    for i in range(warmup + calls):
        args = inputs(i)
        start = time.perf_counter()
        out = call(*args)
        times.append(time.perf_counter() - start)
    steady = sorted(times[warmup:])
    figures = {
        "first_call_s": round(times[0], 3),
        "median_ms": round(1e3 * steady[len(steady) // 2], 3),
        "best_ms": round(1e3 * steady[0], 3),
    }
    return out, figures
