"""Reserve a v6e 4x4 slice and start one actor per chip: tpuray.SlicePlacementGroup vs Ray 2.60's
ray.util.tpu.SlicePlacementGroup, alternating on the same emulated cluster (4 emulated hosts x 4 chips).

    .venv/bin/python benchmarks/bench_slices.py [--repeats 5]

Times, per run: `reserve` = constructor until the placement group is ready; `total` = reserve + 16
trivial actors (resources={"TPU": 1}) started in the slice's bundles and answering a ping. Prints medians
and ours/Ray ratios (goal: total ratio <= 0.8), and the floor both share: the same 16 actors started with no
placement group (worker process start on this machine). Also checks that Ray's own SlicePlacementGroup reserves
the emulated slice (the emulator looks real to Ray).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.tpu import SlicePlacementGroup as RaySlicePlacementGroup

from tpuray import SlicePlacementGroup
from tpuray.emulator import EmulatedCluster, SliceRequest


@ray.remote(num_cpus=0)
class Chip:
    def ping(self) -> str:
        return os.environ.get("TPU_VISIBLE_CHIPS", "")


def reserve_once(make) -> float:
    t0 = time.perf_counter()
    spg = make()
    ray.get(spg.placement_group.ready())
    elapsed = time.perf_counter() - t0
    spg.shutdown()
    while ray.available_resources().get("TPU", 0) < 16:
        time.sleep(0.01)
    return elapsed


def run_once(make, chips_per_host: int) -> tuple[float, float, list[str]]:
    t0 = time.perf_counter()
    spg = make()
    pg = spg.placement_group
    ray.get(pg.ready())
    t_reserve = time.perf_counter() - t0
    actors = [
        Chip.options(
            resources={"TPU": 1},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i // chips_per_host
            ),
        ).remote()
        for i in range(spg.num_hosts * chips_per_host)
    ]
    chips = ray.get([a.ping.remote() for a in actors])
    t_total = time.perf_counter() - t0
    selector = spg.bundle_label_selector
    for a in actors:
        ray.kill(a)
    spg.shutdown()
    while ray.available_resources().get("TPU", 0) < 16:  # slice fully released before the next run
        time.sleep(0.05)
    return t_reserve, t_total, [s.get("ray.io/tpu-slice-name", "") for s in selector] + chips


def actors_only_once(num_chips: int) -> float:
    """The floor both implementations share: the same 16 actors with no placement group at all."""
    t0 = time.perf_counter()
    actors = [Chip.options(resources={"TPU": 1}).remote() for _ in range(num_chips)]
    ray.get([a.ping.remote() for a in actors])
    elapsed = time.perf_counter() - t0
    for a in actors:
        ray.kill(a)
    while ray.available_resources().get("TPU", 0) < num_chips:
        time.sleep(0.05)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of reserve + 16 actors, per implementation"
    )
    parser.add_argument(
        "--reserve-repeats", type=int, default=20, help="runs of reserve only, per implementation"
    )
    args = parser.parse_args()

    impls = {
        "tpuray.SlicePlacementGroup": lambda: SlicePlacementGroup(
            topology="4x4", accelerator_version="v6e", timeout_s=120
        ),
        "ray.util.tpu.SlicePlacementGroup": lambda: RaySlicePlacementGroup(
            topology="4x4", accelerator_version="v6e", head_reservation_timeout_s=120
        ),
    }
    with EmulatedCluster([SliceRequest("TPU-V6E", "4x4")], connect=True) as cluster:
        (sl,) = cluster.slices
        print(f"{cluster!r}\nos.cpu_count()={os.cpu_count()}  repeats={args.repeats} (alternating)")
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
        for name, make in impls.items():  # warm-up: worker pools, code paths
            _, _, seen = run_once(make, 4)
            assert seen[0] == sl.name, f"{name} did not reserve the emulated slice: {seen[:4]}"
            print(f"warm-up {name}: reserved emulated slice {seen[0]}, chips {sorted(seen[4:])[:4]}...")
        reserve_only: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(args.reserve_repeats):
            for name, make in impls.items():
                reserve_only[name].append(reserve_once(make))
        floor: list[float] = []
        for _ in range(args.repeats):
            for name, make in impls.items():
                t_reserve, t_total, _ = run_once(make, 4)
                results[name].append((t_reserve, t_total))
            floor.append(actors_only_once(16))
        ours, theirs = (results[n] for n in impls)
        med = {
            n: (statistics.median(r for r, _ in v), statistics.median(t for _, t in v))
            for n, v in results.items()
        }
        res = {n: statistics.median(v) for n, v in reserve_only.items()}
        print(f"\nmedians: reserve-only x{args.reserve_repeats}; reserve+16 actors x{args.repeats}")
        print(
            f"{'implementation':34} {'reserve only (s)':>17} {'reserve (s)':>12} {'reserve+16 actors (s)':>22}"
        )
        for name in impls:
            print(f"{name:34} {res[name]:17.4f} {med[name][0]:12.4f} {med[name][1]:22.3f}")
        (o_r, o_t), (r_r, r_t) = med[list(impls)[0]], med[list(impls)[1]]
        o_x, r_x = (res[n] for n in impls)
        print(
            f"{'ratio tpuray / ray':34} {o_x / r_x:17.2f} {o_r / r_r:12.2f} {o_t / r_t:22.2f}   (goal: <= 0.8)"
        )
        f = statistics.median(floor)
        print(f"{'floor: 16 actors, no reservation':34} {'-':>17} {'-':>12} {f:22.3f}")
        print(
            f"above the floor (reserve + placing actors in the slice's bundles): tpuray {o_t - f:+.3f} s, "
            f"ray {r_t - f:+.3f} s"
        )
        print(f"runs: tpuray={[round(t, 2) for _, t in ours]} ray={[round(t, 2) for _, t in theirs]}")
        print(f"floor runs: {[round(t, 2) for t in floor]}")


if __name__ == "__main__":
    main()
