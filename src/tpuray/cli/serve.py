"""`tpuray serve CONFIG.yaml`: run the OpenAI-compatible LLM app described by a YAML file on Ray Serve.

The YAML holds `llm_configs` (a list of LLMConfig dicts, as in Ray Serve LLM) and optionally `api_key`
and `ingress_deployment_config`; a Ray Serve config file (`applications: [{args: {llm_configs: ...}}]`)
works too. The file is validated before Ray is touched.

It runs in the foreground until Ctrl-C (or SIGTERM), then shuts the app down. The cluster is --address,
else RAY_ADDRESS, else the running `tpuray emulate` cluster; a config without TPU slices may also start a
local Ray of its own. To keep it running detached:

  nohup tpuray serve config.yaml > serve.log 2>&1 &      # stop with: kill %1 (or kill PID)

or deploy it with Ray Serve itself: `serve deploy` a Ray Serve config whose application has
import_path tpuray.serve.llm:build_openai_app and these llm_configs as its args (on Kubernetes:
`tpuray k8s --kind rayservice --serve-config config.yaml`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from pathlib import Path
from typing import Any

from tpuray.cli.flags import add_address, add_state_dir, cluster_address
from tpuray.console import quiet_logs


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve LLMs from a YAML config on an OpenAI-compatible endpoint (Ray Serve)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML file with llm_configs (see docs/serve.md)")
    add_address(p)
    add_state_dir(p)
    p.add_argument("--host", default="0.0.0.0", help="HTTP host (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--check", action="store_true", help="validate the config, print the plan and exit")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's, Ray's and the replicas' log lines here (default: vLLM's and Ray's driver lines in a "
        "log file under ~/.tpuray/logs, named at the start; the replicas' in Ray's session logs)",
    )
    p.set_defaults(func=run)


def load_serving_args(path: str | Path):
    import yaml

    from tpuray.cli import UsageError
    from tpuray.serve.llm import LLMServingArgs

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file {str(path)!r} not found")
    try:
        data: Any = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML: {e}") from e
    if isinstance(data, dict) and "applications" in data:
        apps = data["applications"] or []
        if len(apps) != 1 or not isinstance(apps[0], dict):
            raise UsageError(f"{path}: expected exactly one application, found {len(apps)}")
        data = apps[0].get("args") or {}
    if not isinstance(data, dict) or "llm_configs" not in data:
        raise UsageError(f"{path}: expected a mapping with 'llm_configs' (a list of LLMConfig mappings)")
    base = path.parent
    configs = []
    for c in data["llm_configs"]:
        if isinstance(c, str):  # path to a YAML LLMConfig, relative to this file
            c = str((base / c).resolve())
        configs.append(c)
    return LLMServingArgs(**{**data, "llm_configs": configs})


def describe(args) -> str:
    lines = []
    for c in args.llm_configs:
        where = (
            f"{c.topology.pod_type} slice {c.topology.topology} per replica, {c.num_workers} worker(s) x "
            f"{c.chips_per_worker} chip(s), tensor_parallel_size={c.tensor_parallel_size}"
            if c.topology
            else "CPU, in the replica process"
        )
        lines.append(f"  {c.model_id} [{c.task}] <- {c.model_source}: {where}")
    return "\n".join(lines)


def _address(ns: argparse.Namespace, args) -> str | None:
    """The cluster to serve on; None (a new local Ray) only for a config that needs no TPU slice."""
    from tpuray.cli import UsageError

    address = cluster_address(ns.address, ns.state_dir)
    sliced = [c for c in args.llm_configs if c.topology is not None]
    if address is None and sliced:
        c = sliced[0]
        raise UsageError(
            f"model {c.model_id!r} needs a {c.topology.accelerator_type} {c.topology.topology} TPU slice and no Ray "
            "cluster is running here: pass --address, set RAY_ADDRESS or start one with `tpuray emulate up "
            f"-a {c.topology.accelerator_type} -t {c.topology.topology}`"
        )
    return address


def run(ns: argparse.Namespace) -> int:
    logs = quiet_logs("serve", ns.verbose)  # before the configs import vLLM
    args = load_serving_args(ns.config)
    for c in args.llm_configs:
        c.check_model_source()
    print(f"tpuray serve: {len(args.llm_configs)} model(s)\n{describe(args)}")
    if ns.check:
        return 0

    import ray
    from ray import serve

    from tpuray.serve.llm import build_openai_app
    from tpuray.serve.shutdown import shutdown_serve

    level = logging.INFO if logs is None else logging.WARNING
    ray.init(address=_address(ns, args), log_to_driver=ns.verbose, logging_level=level)
    if logs is not None:
        logs.capture()  # again: ray.init set up its own driver logger
        print(f"tpuray serve: vLLM's and Ray's log lines: {logs.path}; the replicas': {_session_logs()}")

    def _stop(signum, frame):  # SIGTERM (kill, Kubernetes) shuts down like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        serve.start(http_options={"host": ns.host, "port": ns.port})
        serve.run(build_openai_app(args), blocking=False)
        auth = " (API key required)" if args.api_key else ""
        print(f"tpuray serve: OpenAI API at http://{ns.host}:{ns.port}/v1{auth}; Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("tpuray serve: shutting down")
    finally:
        shutdown_serve()
        ray.shutdown()
    return 0


def _session_logs() -> str:
    """Ray's log folder of this session (on the head; each node has its own)."""
    from ray._private.worker import global_worker

    return global_worker.node.get_logs_dir_path() if global_worker.node is not None else "Ray's session logs"
