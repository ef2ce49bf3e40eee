"""`tpuray emulate up|down|status|preempt`: a detached local Ray cluster of emulated TPU slices."""

from __future__ import annotations

import argparse
import time

from tpuray.cli import UsageError
from tpuray.cli.flags import add_num_slices, add_slice_shape, add_state_dir
from tpuray.emulator.spec import SLICE_CORES
from tpuray.validation import check_positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "emulate",
        help="run emulated TPU slices as a local Ray cluster (CPU only)",
        description=(
            "Start, stop or inspect a detached local Ray cluster whose nodes are EMULATED TPU hosts: real "
            "raylets with the TPU resources, labels and host env of GKE/KubeRay TPU hosts, computing on CPU."
        ),
    )
    p.add_argument(
        "action",
        choices=("up", "down", "status", "preempt"),
        help="up: start; down: stop; status: show; preempt: emulated spot preemption of a slice or host",
    )
    add_slice_shape(p, accelerator_type="TPU-V6E", topology="2x2")
    add_num_slices(
        p,
        default=None,
        help="number of slices started now (default 1; with --autoscale: 0, slices come on demand)",
    )
    p.add_argument("--head-cpus", type=int, default=4, help="logical CPUs of the CPU-only head node")
    p.add_argument("--cpus-per-chip", type=int, default=2, help="logical CPUs per emulated chip")
    p.add_argument(
        "--cores",
        choices=SLICE_CORES,
        default="shared",
        help="where the slices' processes compute: shared (every core, default) or per_slice (each slice "
        "started now on cores of its own, as a real slice on its own chips: at most one slice per core; "
        "not with --autoscale)",
    )
    p.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="start the head without Ray's dashboard (saves a process; Ray's own tools `ray list actors` "
        "and `serve status` need it)",
    )
    add_state_dir(p)
    _add_autoscale_group(p)
    _add_preempt_group(p)
    p.set_defaults(func=run)


def _add_autoscale_group(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group(
        "autoscale (up)",
        "slices on demand: Ray's own autoscaler starts a whole emulated slice (every host, or none) for each "
        "pending slice reservation (tpuray's or Ray's SlicePlacementGroup, a TorchTrainer(use_tpu=True), a "
        "serving replica on a slice) and stops a slice once all its hosts have been idle --idle-timeout-s; "
        "a preempted host takes its whole slice down and a new one comes up for pending work. See "
        "docs/autoscaling.md",
    )
    a.add_argument("--autoscale", action="store_true", help="start the head with Ray's autoscaler")
    a.add_argument(
        "--max-slices",
        action="append",
        default=None,
        metavar="TYPE:TOPOLOGY=N",
        help="a slice shape the autoscaler may start, at most N at once, e.g. TPU-V6E:4x4=2 (repeat for "
        "several shapes; required with --autoscale)",
    )
    a.add_argument(
        "--idle-timeout-s",
        type=float,
        default=None,
        help="stop a slice once all its hosts have been idle this long (default 60)",
    )


def _add_preempt_group(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "preempt",
        "drain the hosts through Ray's drain API (reason PREEMPTION, with a deadline), as GKE's notice of a "
        "spot/preemptible TPU VM does, and kill them at the deadline",
    )
    g.add_argument("--slice", dest="slice_name", default=None, help="the slice to preempt (all its hosts)")
    g.add_argument("--node-id", default=None, help="or: one host's Ray node id")
    g.add_argument("--notice-s", type=float, default=30.0, help="seconds from notice to kill (default 30)")
    g.add_argument(
        "--restore-after-s",
        type=float,
        default=None,
        help="bring a replacement host back this long after the kill, as a node pool would (default: never)",
    )


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "preempt": _preempt, "down": _down, "status": _status}[args.action](args)


def _up(args: argparse.Namespace) -> int:
    from tpuray.emulator import detached

    autoscale = _autoscale_args(args)
    try:
        state = detached.up(
            args.accelerator_type,
            args.topology,
            args.num_slices,
            head_cpus=args.head_cpus,
            cpus_per_chip=args.cpus_per_chip,
            path=args.state_dir,
            autoscale=autoscale,
            cores=args.cores,
            dashboard=args.dashboard,
        )
    except RuntimeError as e:
        print(f"tpuray emulate up: {e}")
        return 1
    print(f"EMULATED TPU cluster up: {state['description']}")
    _print_state(state)
    print(f"connect with: ray.init(address={state['address']!r})   or   RAY_ADDRESS={state['address']}")
    return 0


def _preempt(args: argparse.Namespace) -> int:
    from tpuray.emulator import detached

    if (args.slice_name is None) == (args.node_id is None):
        raise UsageError("tpuray emulate preempt needs --slice NAME or --node-id ID (one of them)")
    if args.notice_s < 0 or (args.restore_after_s is not None and args.restore_after_s < 0):
        raise UsageError("--notice-s and --restore-after-s must be >= 0")
    try:
        answer = detached.preempt(
            args.slice_name, args.node_id, args.notice_s, args.restore_after_s, path=args.state_dir
        )
    except (RuntimeError, TimeoutError) as e:
        print(f"tpuray emulate preempt: {e}")
        return 1
    target = f"slice {args.slice_name}" if args.slice_name else f"host {args.node_id}"
    back = (
        f"; a replacement comes back {args.restore_after_s:g}s after"
        if args.restore_after_s is not None
        else ""
    )
    print(
        f"EMULATED preemption of {target}: {len(answer['node_ids'])} host(s) draining now, killed in "
        f"{answer['deadline'] - time.time():.0f}s{back}"
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    from tpuray.emulator import detached

    stopped = detached.down(args.state_dir)
    if stopped is None:
        print("no emulated TPU cluster is running")
        return 0
    print(f"EMULATED TPU cluster at {stopped['address']} stopped")
    return 0


def _status(args: argparse.Namespace) -> int:
    from tpuray.emulator import detached

    current = detached.read_state(args.state_dir)
    if current is None:
        print("no emulated TPU cluster is running (start one with `tpuray emulate up`)")
        return 1
    print(f"EMULATED TPU cluster running: {current['description']} (pid {current['pid']})")
    _print_state(current)
    return 0


def _autoscale_args(args: argparse.Namespace) -> dict | None:
    """--autoscale's settings (validated before anything starts), or None; fills --num-slices' default."""
    if not args.autoscale:
        if args.max_slices is not None or args.idle_timeout_s is not None:
            raise UsageError("--max-slices and --idle-timeout-s are only valid with --autoscale")
        args.num_slices = 1 if args.num_slices is None else args.num_slices
        check_positive_int("--num-slices", args.num_slices)
        return None
    from tpuray.emulator.autoscale import AutoscaleSpec, parse_max_slices

    if not args.max_slices:
        raise UsageError("--autoscale needs --max-slices TYPE:TOPOLOGY=N (e.g. TPU-V6E:4x4=2)")
    args.num_slices = 0 if args.num_slices is None else args.num_slices
    check_positive_int("--num-slices", args.num_slices, minimum=0)
    idle = 60.0 if args.idle_timeout_s is None else args.idle_timeout_s
    AutoscaleSpec(parse_max_slices(args.max_slices), idle)  # ConfigError naming the bad value
    return {"max_slices": list(args.max_slices), "idle_timeout_s": idle}


def _print_state(state: dict) -> None:
    print(f"  address: {state['address']}")
    if state.get("dashboard"):
        print(
            f"  Ray dashboard: {state['dashboard']} (with RAY_ADDRESS set: ray status, ray list actors, serve status)"
        )
    if state.get("autoscale"):
        print(f"  autoscale: {state['autoscale']} (see `tpuray status` for slices on demand)")
    for s in state["slices"]:
        print(
            f"  slice {s['name']}: {s['accelerator_type']} {s['topology']} ({s['pod_type']}), "
            f"{s['hosts']} host(s) x {s['chips_per_host']} chips [emulated]"
            + (f", on core(s) {','.join(map(str, s['cores']))}" if s.get("cores") else "")
        )
