"""`tpuray status`: the TPU slices of a Ray cluster (real or emulated) and their free chips."""

from __future__ import annotations

import argparse
import logging

from tpuray.cli.flags import add_address, add_state_dir, cluster_address


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
    add_address(p)
    add_state_dir(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    address = cluster_address(args.address, args.state_dir)
    if address is None:
        print("no Ray cluster to inspect: pass --address, set RAY_ADDRESS or run `tpuray emulate up`")
        return 1

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
        _print_serve_apps()
    finally:
        ray.shutdown()
    return 0


def _print_autoscaling(slices: list) -> None:
    """Pending slice demand, and the slices of an autoscaling emulated cluster by state."""
    from tpuray.slices import pending_slice_demand
    from tpuray.slices.autoscaler import published_node_types, published_slices

    demand = pending_slice_demand()
    wanted = ", ".join(f"{n} x {pod}" for pod, n in sorted(demand.items())) or "none"
    print(f"pending slice demand: {wanted}")
    types = published_node_types()
    if types is None:
        return
    shapes = ", ".join(f"{t.accelerator_type} {t.topology} ({t.name}) <= {t.max_slices}" for t in types)
    print(f"autoscaling (Ray's autoscaler, EMULATED slices): {shapes}")
    idle = {s.name: s.idle for s in slices}
    for name, info in sorted(published_slices().items()):
        state: str = info["state"]
        if state == "up":
            state = "idle" if idle.get(name) else "in use"
        elif state == "starting":
            state = f"starting ({info['hosts_up']}/{info['hosts']} hosts up)"
        print(f"  {name}: {info['node_type']}, {state}")


def _print_serve_apps() -> None:
    """Ray Serve's applications on the cluster, each with its state and HTTP endpoint."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    details = client.get_serve_details()
    http = details.get("http_options") or {}
    base = f"http://{http.get('host', '0.0.0.0')}:{http.get('port', 8000)}"
    apps = details.get("applications") or {}
    print(f"Ray Serve: {len(apps)} app(s)" + ("" if apps else " (Serve is running)"))
    for name, app in sorted(apps.items()):
        route = app.get("route_prefix")
        llm = any(d.startswith(("LLMServer", "LLMRouter")) for d in app.get("deployments") or {})
        where = (
            "no HTTP route" if route is None else base + route.rstrip("/") + ("/v1 (OpenAI)" if llm else "")
        )
        status = app.get("status")
        print(f"  {name}: {getattr(status, 'value', status)}, {where}")
