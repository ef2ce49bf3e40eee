"""Helpers the benchmark scripts share (each script runs on its own: `python benchmarks/bench_x.py`)."""

from __future__ import annotations

import socket


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
