"""all_reduce: emulated ``tpu_dist`` vs raw gloo on the same CPU tensors, in one run.

    .venv/bin/python benchmarks/bench_collectives.py          # 2 and 4 ranks, 1 KiB .. 64 MiB
    .venv/bin/python benchmarks/bench_collectives.py --full   # 1 KiB .. 256 MiB, more repetitions

Each rank process joins two groups over the same ranks: the default ``tpu_dist`` group and a gloo
group. For every size it all-reduces (SUM, float32) the same CPU buffer through gloo directly and
through ``tpu_dist`` (wrapped as an emulated tpu tensor without copying), alternating, and reports
the median time per call and the ratio tpu_dist / gloo (goal: <= 1.05 at 64 MiB).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _sizes(full: bool) -> list[int]:
    top = 256 if full else 64
    sizes, n = [], 1024
    while n <= top * 1024 * 1024:
        sizes.append(n)
        n *= 4 if full else 16
    if sizes[-1] != top * 1024 * 1024:
        sizes.append(top * 1024 * 1024)
    return sizes


def _reps(nbytes: int, full: bool) -> int:
    base = 30 if nbytes <= 1 << 20 else 10
    return base * (2 if full else 1)


def _worker(rank: int, world: int, port: int, sizes: list[int], full: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tpuray.runtime import activate
    from tpuray.runtime.device import wrap

    activate()
    dist.init_process_group(backend="tpu_dist")
    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in sizes:
        local = torch.ones(nbytes // 4, dtype=torch.float32)
        tpu = wrap(local)  # the same memory, seen as an emulated tpu tensor
        times = {"gloo": [], "tpu_dist": []}
        for _ in range(2):  # warm-up
            dist.all_reduce(local, group=gloo)
            dist.all_reduce(tpu)
        pairs = [("gloo", local, gloo), ("tpu_dist", tpu, None)]
        for i in range(_reps(nbytes, full)):
            for name, t, group in pairs if i % 2 == 0 else pairs[::-1]:
                dist.barrier(group=gloo)
                start = time.perf_counter()
                dist.all_reduce(t, group=group)
                times[name].append(time.perf_counter() - start)
        rows.append((nbytes, statistics.median(times["gloo"]), statistics.median(times["tpu_dist"])))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(nbytes: int) -> str:
    return f"{nbytes // (1 << 20)} MiB" if nbytes >= 1 << 20 else f"{nbytes // 1024} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--full", action="store_true", help="1 KiB .. 256 MiB in steps of 4x, more repetitions"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    sizes = _sizes(args.full)
    ctx = mp.get_context("spawn")
    print(f"all_reduce SUM float32, median seconds per call; os.cpu_count()={os.cpu_count()}")
    print(f"{'ranks':>5} {'size':>8} {'gloo':>10} {'tpu_dist':>10} {'ratio':>6}")
    for world in args.ranks:
        queue = ctx.SimpleQueue()
        ctx_procs = mp.start_processes(
            _worker,
            args=(world, _free_port(), sizes, args.full, queue),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        rows = queue.get()
        ctx_procs.join()
        for nbytes, t_gloo, t_tpu in rows:
            print(f"{world:>5} {_fmt(nbytes):>8} {t_gloo:>10.6f} {t_tpu:>10.6f} {t_tpu / t_gloo:>6.2f}")


if __name__ == "__main__":
    main()
