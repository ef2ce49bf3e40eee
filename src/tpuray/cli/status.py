"""`tpuray status`: the TPU slices of a Ray cluster (real or emulated) and their free chips."""

from __future__ import annotations

import argparse
import logging
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="show the TPU slices of a Ray cluster",
        description=(
            "Connect to a Ray cluster (--address, else RAY_ADDRESS, else the running `tpuray emulate` "
            "cluster) and list its TPU slices: name, type, topology, hosts, free chips; emulated slices "
            "are marked EMULATED. Also: pending slice demand (slice reservations waiting for a slice) and, "
            "on an autoscaling emulated cluster, the slices Ray's autoscaler is starting, keeping idle or "
            "stopping."
        ),
    )
    p.add_argument("--address", default=None, help="Ray address (host:port)")
    p.add_argument("--state-dir", default=None, help="state dir of `tpuray emulate` (~/.tpuray/emulator)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tpuray.emulator import detached

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        state = detached.read_state(args.state_dir)
        if state is None:
            print("no Ray cluster to inspect: pass --address, set RAY_ADDRESS or run `tpuray emulate up`")
            return 1
        address = state["address"]

    import ray

    from tpuray.slices import format_slices, list_slices

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        slices = list_slices()
        emulated = sum(1 for s in slices if s.emulated)
        print(f"Ray cluster {address}: {len(nodes)} node(s), {len(slices)} TPU slice(s)", end="")
        print(f" ({emulated} EMULATED)" if emulated else "")
        print(format_slices(slices))
        _print_autoscaling(slices)
    finally:
        ray.shutdown()
    return 0


def _print_autoscaling(slices: list) -> None:
    """Pending slice demand, and the slices of an autoscaling emulated cluster by state."""
    from tpuray.emulator.autoscale import published_node_types, published_slices
    from tpuray.slices import pending_slice_demand

    demand = pending_slice_demand()
    wanted = ", ".join(f"{n} x {pod}" for pod, n in sorted(demand.items())) or "none"
    print(f"pending slice demand: {wanted}")
    types = published_node_types()
    if types is None:
        return
    shapes = ", ".join(
        f"{t['accelerator_type']} {t['topology']} ({name}) <= {t['max_slices']}" for name, t in types.items()
    )
    print(f"autoscaling (Ray's autoscaler, EMULATED slices): {shapes}")
    idle = {s.name: s.idle for s in slices}
    for name, info in sorted(published_slices().items()):
        state = info["state"]
        if state == "up":
            state = "idle" if idle.get(name) else "in use"
        elif state == "starting":
            state = f"starting ({info['hosts_up']}/{info['hosts']} hosts up)"
        print(f"  {name}: {info['node_type']}, {state}")
