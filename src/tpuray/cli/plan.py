"""`tpuray plan`: show how a TPU slice is laid out and what every process's environment is."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tpuray.cli.flags import add_num_slices, add_slice_shape
from tpuray.validation import ConfigError, check_positive_int

EPILOG = """\
examples:
  tpuray plan --accelerator-type TPU-V6E --topology 4x4
  tpuray plan --accelerator-type v5p --topology 2x2x2 --json
  tpuray plan --accelerator-type TPU-V6E --topology 2x4 --chips-per-process 2
  tpuray plan --accelerator-type tpu7x --topology 4x4x4 --num-slices 2 --png mesh.png

accelerator types: TPU-V4, TPU-V5LITEPOD (v5e), TPU-V5P, TPU-V6E, TPU-V7X (tpu7x); any case.
topologies: AxB for v5e/v6e (1x1 2x2 2x4 2x8 4x4 4x8 8x8 8x16 16x16), AxBxC for v4/v5p/v7x.
Planning needs no TPU and no Ray cluster: it only computes.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="show hosts, chips, mesh, rank layout and per-process env of a TPU slice",
        description=(
            "Plan a TPU slice: number of hosts and chips, the ICI mesh, which rank drives which chip "
            "on which host, and the libtpu/TorchTPU environment of every process."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_slice_shape(p)
    add_num_slices(p, default=1, help="identical slices (default 1)")
    p.add_argument(
        "--chips-per-process",
        type=int,
        default=1,
        metavar="N",
        help="chips each process drives: 1, 2, 4 or 8",
    )
    p.add_argument(
        "--hostnames",
        metavar="H0,H1,..",
        help="comma-separated worker hostnames of a single slice (default: localhost for one host, "
        "else <pod type>-w<i>)",
    )
    p.add_argument("--port-base", type=int, default=8476, metavar="PORT", help="TPU_PROCESS_PORT base (8476)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--png", metavar="FILE", help="also draw the chip mesh to FILE (.png)")
    p.add_argument(
        "--limit",
        type=int,
        default=64,
        metavar="N",
        help="ranks listed in the text report (0: all; default 64)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tpuray.topology import SliceTopology
    from tpuray.topology.report import plan_dict, plan_text

    topo = SliceTopology.parse(args.accelerator_type, args.topology)
    check_positive_int("--limit", args.limit, minimum=0)
    hostnames = None
    if args.hostnames is not None:
        if args.num_slices != 1:
            raise ConfigError("--hostnames works with --num-slices 1 only")
        hostnames = [[h.strip() for h in args.hostnames.split(",")]]
    plan = plan_dict(topo, args.num_slices, args.chips_per_process, hostnames, args.port_base)
    if args.png:
        from tpuray.topology.draw import draw_mesh

        draw_mesh(topo, args.png)
    text = json.dumps(plan, indent=1) if args.json else plan_text(plan, topo, limit=args.limit)
    if args.png and not args.json:
        text += f"\n\nmesh drawn to {args.png}"
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `tpuray plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
