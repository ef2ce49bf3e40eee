"""tpuray's own bookkeeping on a fleet-sized cluster state, on paper: no Ray is started.

A synthetic cluster state as Ray reports it (`ray.nodes()`, available resources per node, draining
nodes, `placement_group_table()`) of 1,024 to 8,192 TPU hosts in slices of four generations (v6e 4x4,
v5e 4x4, v5p 2x2x4, v4 2x2x4: four hosts each), half the slices held by a named reservation, 64 slices
asked for and pending, two hosts draining. Times, per size, the functions `tpuray status` and every
reservation run: the slice grouping and holders (`slices_from_state`), the status table
(`format_slices`), the pending demand (`pending_slice_demand`) and the fail-fast shape check of a fixed
cluster (`known_slices` + `fixed_cluster_problem`), with tracemalloc's peak of the whole pass.
Goal: each under 1 s at 4,096 hosts / 1,024 slices, time and memory growing linearly (the per-host
figures stay flat as the size doubles).

    .venv/bin/python benchmarks/bench_bookkeeping.py [--sizes 1024 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from typing import Any

from tpuray.constants import (
    ACCELERATOR_LABEL,
    POD_TYPE_LABEL,
    SLICE_NAME_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    WORKER_ID_LABEL,
)
from tpuray.slices.demand import fixed_cluster_problem
from tpuray.slices.inventory import format_slices, known_slices, pending_slice_demand, slices_from_state
from tpuray.topology import SliceTopology

SHAPES = [("TPU-V6E", "4x4"), ("TPU-V5LITEPOD", "4x4"), ("TPU-V5P", "2x2x4"), ("TPU-V4", "2x2x4")]
PENDING = 64


def cluster_state(hosts: int) -> dict[str, Any]:
    """`hosts` TPU hosts in four-host slices of SHAPES in turn, as Ray reports them."""
    topos = [SliceTopology.parse(a, t) for a, t in SHAPES]
    nodes, available, pg_table = [], {}, {}
    for index in range(hosts // 4):
        topo = topos[index % len(topos)]
        name = f"slice-{index:05d}"
        held = index % 2 == 0
        bundles = {}
        for worker in range(topo.num_hosts):
            node_id = f"{index:08x}{worker:04x}".ljust(56, "0")
            resources = {TPU_RESOURCE: float(topo.chips_per_host), "CPU": 8.0, name: 1.0}
            if worker == 0:
                resources[topo.head_resource] = 1.0
            labels = {
                SLICE_NAME_LABEL: name,
                WORKER_ID_LABEL: str(worker),
                POD_TYPE_LABEL: topo.pod_type,
                TOPOLOGY_LABEL: topo.topology,
                ACCELERATOR_LABEL: topo.generation.accelerator_type,
            }
            nodes.append({"NodeID": node_id, "Alive": True, "Labels": labels, "Resources": resources})
            available[node_id] = {**resources, TPU_RESOURCE: 0.0} if held else dict(resources)
            bundles[worker] = node_id
        if held:
            pg_table[f"{index:032x}"] = {
                "name": f"train:run-{index}#ab12",
                "state": "CREATED",
                "bundles_to_node_id": bundles,
            }
    for index in range(PENDING):
        head = topos[index % len(topos)].head_resource
        pg_table[f"p{index:031x}"] = {
            "name": "",
            "state": "PENDING",
            "bundles": {0: {head: 1.0}},
            "bundles_to_node_id": {},
        }
    draining = {nodes[0]["NodeID"], nodes[5]["NodeID"]}
    return {"nodes": nodes, "available": available, "draining": draining, "pg_table": pg_table}


def timed(fn, repeat: int) -> float:
    """The best of `repeat` wall times, in seconds (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(hosts: int, repeat: int) -> dict[str, float]:
    state = cluster_state(hosts)
    ask = SliceTopology.parse("TPU-V6E", "8x8")  # a shape the fleet has none of: refused
    slices = slices_from_state(state["nodes"], state["available"], state["draining"], state["pg_table"])
    steps = {
        "slices": lambda: slices_from_state(
            state["nodes"], state["available"], state["draining"], state["pg_table"]
        ),
        "status table": lambda: format_slices(slices),
        "demand": lambda: pending_slice_demand(state["pg_table"]),
        "shape check": lambda: fixed_cluster_problem(ask, 1, known_slices(state["nodes"])),
    }
    figures = {name: timed(fn, repeat) for name, fn in steps.items()}
    gc.collect()
    tracemalloc.start()
    for fn in steps.values():
        fn()
    figures["peak MiB"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="hosts per run"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per figure (the best is kept)")
    args = parser.parse_args()
    print(
        f"{'hosts':>6} {'slices':>6}  "
        + "  ".join(f"{k:>20}" for k in ("slices", "status table", "demand", "shape check"))
        + "   peak MiB"
    )
    for hosts in args.sizes:
        f = measure(hosts, args.repeat)
        cells = [
            f"{1e3 * f[k]:8.1f} ms {1e6 * f[k] / hosts:5.1f} us/h"
            for k in ("slices", "status table", "demand", "shape check")
        ]
        print(f"{hosts:>6} {hosts // 4:>6}  " + "  ".join(cells) + f"   {f['peak MiB']:8.1f}")


if __name__ == "__main__":
    main()
