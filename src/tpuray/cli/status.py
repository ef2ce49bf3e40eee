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
            "are marked EMULATED."
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
    finally:
        ray.shutdown()
    return 0
