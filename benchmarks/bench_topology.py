"""Plan the largest TPU slices: a 9,216-chip v7x (16x24x24) and an 8,960-chip v5p (16x20x28).

Times tpuray.topology (parse + full rank layout + the environment of every process) and, as the
anchor, the closest thing Ray 2.60 has: its topology helpers in ray/_private/accelerators/tpu.py and
ray/util/tpu.py, which compute chips / chips per host / pod type / worker count from a topology
string (Ray has no rank layout or per-process env to compare with). Goal: full plan < 50 ms.

    .venv/bin/python benchmarks/bench_topology.py
"""

from __future__ import annotations

import os
import statistics
import time

from tpuray.topology import SliceTopology, worker_envs

CASES = [("TPU-V7X", "16x24x24"), ("TPU-V5P", "16x20x28")]
REPEAT = 15


def timed(fn, repeat: int = REPEAT) -> tuple[float, float, object]:
    """Median wall time and median CPU time (this process only, so less sensitive to other load
    on the machine) in ms over `repeat` runs after a warm-up run, and the result."""
    out = fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu), out


def _goal(wall: float, cpu: float) -> str:
    if wall < 50:
        return "< 50 ms: met"
    if cpu < 50:
        return f"< 50 ms: met on CPU time; wall inflated (load {os.getloadavg()[0]:.1f})"
    return "< 50 ms: missed"


def ours_summary(acc: str, topo: str):
    t = SliceTopology.parse(acc, topo)
    return t.num_chips, t.chips_per_host, t.num_hosts, t.pod_type


def ours_full(acc: str, topo: str):
    t = SliceTopology.parse(acc, topo)
    layout = t.layout()
    envs = worker_envs(t)
    return t, layout, envs


def ray_summary(acc: str, topo: str):
    from ray._private.accelerators.tpu import (
        get_chips_per_host,
        get_num_chips_from_topology,
        infer_tpu_pod_type_from_topology,
    )
    from ray.util.tpu import get_tpu_version_from_type, get_tpu_worker_resources

    version = get_tpu_version_from_type(acc)
    chips = get_num_chips_from_topology(topo)
    cph = get_chips_per_host(topo, version)
    workers, _ = get_tpu_worker_resources(topo, acc, tpu_resource_per_chip=1)
    return chips, cph, workers, infer_tpu_pod_type_from_topology(topo, acc)


def main() -> None:
    import ray
    from ray._private.accelerators.tpu import TPUAcceleratorManager

    print(
        f"os.cpu_count()={os.cpu_count()}  load average {os.getloadavg()[0]:.2f}  "
        f"ray {ray.__version__}  times: median wall ms (median CPU ms)\n"
    )
    rows = [("slice", "what", "tpuray ms", "Ray 2.60 ms", "Ray/tpuray", "goal")]
    for acc, topo in CASES:
        name = f"{acc} {topo}"
        med, best, ours = timed(lambda a=acc, t=topo: ours_summary(a, t), repeat=2000)
        rmed, rbest, theirs = timed(lambda a=acc, t=topo: ray_summary(a, t), repeat=2000)
        assert ours == theirs, (ours, theirs)  # same chips, chips/host, hosts, pod type
        rows.append((name, "chips, chips/host, hosts, pod type", f"{med:.4f} ({best:.4f})",
                     f"{rmed:.4f} ({rbest:.4f})", f"{rmed / med:.2f}x", ""))  # fmt: skip
        med, best, (t, layout, envs) = timed(lambda a=acc, t=topo: ours_full(a, t))
        assert len(layout) == len(envs) == t.num_chips
        rows.append((name, f"full plan: layout + env x{len(envs)}", f"{med:.2f} ({best:.2f})",
                     "n/a (no equivalent)", "", _goal(med, best)))  # fmt: skip
        valid = TPUAcceleratorManager.is_valid_tpu_accelerator_topology(acc.split("-")[1], topo)
        print(f"{name}: {t.describe()}; Ray's valid-topology table accepts it: {valid}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
