"""CPU an IDLE emulated cluster burns: Ray's defaults vs tpuray's QUIET_RAY_ENV (what the test suite sets),
alternating, each run a fresh cluster in its own subprocess (the settings must be in place before Ray starts).

    .venv/bin/python benchmarks/bench_idle_cluster.py [--rounds 3] [--settle 20] [--window 30]

Each run starts the test suite's default layout (a 4-CPU head + two v6e 2x2 hosts), connects a driver, waits
`settle` seconds for start-up work to end, then sums the CPU seconds (user + system) that every process of
the cluster (the subprocess's descendants: GCS, raylets, dashboard agents, workers) uses over `window`
seconds, with nothing submitted. Prints the median per variant and quiet / default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from tpuray.emulator.hosts import QUIET_RAY_ENV


def _one_run(settle: float, window: float) -> None:
    """In the subprocess: start the cluster, measure its idle CPU, print it as JSON."""
    import psutil

    from tpuray.emulator import EmulatedCluster, SliceRequest

    with EmulatedCluster([SliceRequest("TPU-V6E", "2x2", count=2)], head_cpus=4) as cluster:
        cluster.connect(namespace="bench-idle")
        time.sleep(settle)
        me = psutil.Process()

        def cpu() -> dict[int, float]:
            out = {}
            for p in me.children(recursive=True):
                try:
                    t = p.cpu_times()
                    out[p.pid] = t.user + t.system
                except psutil.Error:
                    pass
            return out

        before, driver_before = cpu(), sum(me.cpu_times()[:2])
        time.sleep(window)
        after, driver_after = cpu(), sum(me.cpu_times()[:2])
        cluster_s = sum(after[pid] - before[pid] for pid in after if pid in before)
        print(
            json.dumps(
                {"cluster_s": cluster_s, "driver_s": driver_after - driver_before, "procs": len(after)}
            )
        )


def _run(quiet: bool, settle: float, window: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in QUIET_RAY_ENV}
    if quiet:
        env.update(QUIET_RAY_ENV)
    cmd = [sys.executable, __file__, "--one", "--settle", str(settle), "--window", str(window)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="runs per variant, alternated")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after start-up before measuring")
    ap.add_argument("--window", type=float, default=30.0, help="seconds measured")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        _one_run(args.settle, args.window)
        return
    print(
        f"idle emulated cluster (head + two v6e 2x2 hosts), CPU seconds per {args.window:.0f} s; "
        f"os.cpu_count()={os.cpu_count()}"
    )
    results: dict[str, list[float]] = {"default": [], "quiet": []}
    for r in range(args.rounds):
        for name in ("default", "quiet"):
            res = _run(name == "quiet", args.settle, args.window)
            results[name].append(res["cluster_s"])
            print(
                f"  round {r + 1} {name:7s}: cluster {res['cluster_s']:.2f} s over {res['procs']} processes, "
                f"driver {res['driver_s']:.2f} s",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"median: Ray defaults {med['default']:.2f} s, QUIET_RAY_ENV {med['quiet']:.2f} s, "
        f"quiet / default = {med['quiet'] / med['default']:.2f}"
    )


if __name__ == "__main__":
    main()
