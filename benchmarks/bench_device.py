"""Per-op overhead of the emulated ``tpu`` device vs plain CPU tensors, in one run.

    .venv/bin/python benchmarks/bench_device.py

Every op on an emulated tpu tensor goes through Python (``__torch_dispatch__``: unwrap, run the CPU
kernel, wrap), so small ops pay a fixed per-op cost on top of the CPU kernel, and large ops converge
to the CPU time. Reports the median time per call and the ratio tpu / cpu.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn


def _medians(f_cpu, f_tpu, reps: int) -> tuple[float, float]:
    """Median seconds per call of each, measured interleaved so machine noise hits both alike."""
    for _ in range(3):
        f_cpu(), f_tpu()
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(reps):
        for i, fn in enumerate((f_cpu, f_tpu)):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _cases(device: str):
    torch.manual_seed(0)
    small = torch.randn(8, 8, device=device)
    big = torch.randn(512, 512, device=device)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device=device)

    def step():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()

    return [
        ("add 8x8", lambda: small + small, 2000),
        ("matmul 512x512", lambda: big @ big, 50),
        ("sum 512x512", lambda: big.sum(), 500),
        ("torch.ones(8, 8, device=)", lambda: torch.ones(8, 8, device=device), 2000),
        ("MLP train step (64-256-64, b=32)", step, 200),
    ]


def main() -> None:
    from tpuray.runtime import activate

    activate()
    print(
        f"median seconds per call; os.cpu_count()={os.cpu_count()}, torch threads={torch.get_num_threads()}"
    )
    print(f"{'op':<34} {'cpu':>11} {'tpu (emulated)':>15} {'ratio':>7} {'overhead':>10}")
    for (name, f_cpu, reps), (_, f_tpu, _) in zip(_cases("cpu"), _cases("tpu"), strict=True):
        t_cpu, t_tpu = _medians(f_cpu, f_tpu, reps)
        print(
            f"{name:<34} {t_cpu:>11.6f} {t_tpu:>15.6f} {t_tpu / t_cpu:>7.2f} {(t_tpu - t_cpu) * 1e6:>8.1f}us"
        )


if __name__ == "__main__":
    main()
