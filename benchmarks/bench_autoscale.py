"""Slices on demand: a pending slice reservation to its placement group ready through Ray's autoscaler
(`EmulatedCluster(autoscale=True)`), split into the autoscaler's decision and the hosts' start, side by
side with the same slice started by hand (`EmulatedCluster.add_slices`, then the same reservation); then
the seeded random churn (tpuray.emulator.churn) over 3 slice shapes, audited after every event.

    .venv/bin/python benchmarks/bench_autoscale.py                  # v6e 4x4 (4 hosts), 3 trials, 20 cycles
    .venv/bin/python benchmarks/bench_autoscale.py --shape TPU-V4:2x2x2 --trials 2 --cycles 5

Decision: from the reservation's call to the moment Ray's autoscaler had the provider launch the slice
(the provider records it); start: from there to the placement group ready (every host started, worker 0
last, then the reservation placed). Hand: add_slices (every host started) + the same reservation. The
autoscaler runs one round a second (AUTOSCALER_UPDATE_INTERVAL_S=1, Ray's smallest), so a decision waits
0-1 s for the next round. One cluster for everything (each autoscaled slice idles out, 2 s, each hand slice is removed):
autoscaled and hand trials alternate, then the churn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CHURN_SHAPES = [("TPU-V4", "2x2x2"), ("TPU-V6E", "2x2"), ("TPU-V5E", "2x2")]


def autoscaled_trial(cluster, accel: str, topology: str) -> dict:  # type: ignore[no-untyped-def]
    from tpuray.slices.placement import SlicePlacementGroup

    t0 = time.time()
    spg = SlicePlacementGroup(topology, accel, timeout_s=600)
    ready = time.time()
    (name,) = spg._slice_names
    launched = cluster.autoscaled_slices()[name]["created_at"]
    spg.shutdown()
    while name in cluster.autoscaled_slices():  # idles out, whole, before the next trial
        time.sleep(0.2)
    return {"total_s": ready - t0, "decision_s": launched - t0, "start_s": ready - launched}


def hand_trial(cluster, accel: str, topology: str) -> dict:  # type: ignore[no-untyped-def]
    from tpuray.emulator import SliceRequest
    from tpuray.slices.placement import SlicePlacementGroup

    t0 = time.time()
    (sl,) = cluster.add_slices(SliceRequest(accel, topology))
    started = time.time()
    spg = SlicePlacementGroup(topology, accel, timeout_s=600)
    ready = time.time()
    spg.shutdown()
    cluster.remove_slice(sl.name)
    return {"total_s": ready - t0, "start_s": started - t0, "reserve_s": ready - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="TPU-V6E:4x4", help="TYPE:TOPOLOGY measured (default TPU-V6E:4x4)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--cycles", type=int, default=20, help="churn cycles (0: none)")
    p.add_argument("--seed", type=int, default=24)
    args = p.parse_args()
    accel, topology = args.shape.split(":")

    from tpuray.emulator import EmulatedCluster
    from tpuray.emulator.churn import run_churn

    shapes = {(accel, topology): 1, **{s: 1 for s in CHURN_SHAPES}}
    cluster = EmulatedCluster(
        [], head_cpus=2, cpus_per_chip=1, autoscale=True, max_slices=shapes, idle_timeout_s=2
    )
    out: dict = {"shape": args.shape}
    with cluster:
        cluster.connect()
        auto, hand = [], []
        for _ in range(args.trials):  # side by side, alternating: the machine's load hits both alike
            auto.append(autoscaled_trial(cluster, accel, topology))
            hand.append(hand_trial(cluster, accel, topology))
        out["autoscaled"], out["hand"] = auto, hand
        if args.cycles:
            report = run_churn(cluster, CHURN_SHAPES, cycles=args.cycles, seed=args.seed)
            out["churn"] = {
                "cycles": report.cycles,
                "events": len(report.events),
                "audits": report.audits,
                "partial": report.partial,
                "leaked": report.leaked,
                "slices": len(report.slices_started),
                "seconds": round(report.seconds, 1),
            }

    med = {k: statistics.median(t[k] for t in auto) for k in auto[0]}
    hmed = {k: statistics.median(t[k] for t in hand) for k in hand[0]}
    print(f"\n{args.shape}: pending reservation -> placement group ready (median of {args.trials})")
    print(
        f"  autoscaled: {med['total_s']:.2f} s = decision {med['decision_s']:.2f} s + hosts start {med['start_s']:.2f} s"
    )
    print(
        f"  by hand:    {hmed['total_s']:.2f} s = hosts start {hmed['start_s']:.2f} s + reserve {hmed['reserve_s']:.2f} s"
    )
    over = med["total_s"] - hmed["total_s"]
    print(f"  autoscaled - hand: {over:+.2f} s  (goal <= 2 s: {'met' if over <= 2 else 'NOT met'}); "
          f"ratio {med['total_s'] / hmed['total_s']:.2f}")  # fmt: skip
    if "churn" in out:
        c = out["churn"]
        print(f"churn: {c['cycles']} cycles, {c['events']} events, {c['slices']} slices started: "
              f"{c['partial']} partial, {c['leaked']} leaked ({c['seconds']} s)")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
