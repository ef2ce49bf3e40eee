"""A detached emulated cluster for the CLI: `tpuray emulate up` outlives the command.

`up()` spawns `python -m tpuray.emulator.detached` in its own session; that process runs an
EmulatedCluster and writes a state file (pid, address, slices) once the cluster is ready. `down()`
sends it SIGTERM and it shuts the cluster down (Ray's process reaper stops the nodes even if it is
killed). The state lives in $TPURAY_STATE_DIR or ~/.tpuray/emulator.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tpuray.constants import STATE_DIR_ENV
from tpuray.emulator.spec import SliceCores
from tpuray.validation import ConfigError, check_positive_int

STATE_FILE = "cluster.json"
REQUESTS_DIR = "requests"  # preempt requests from the CLI to the detached process
LOG_FILE = "emulator.log"


def state_dir(path: str | os.PathLike | None = None) -> Path:
    if path is None:
        path = os.environ.get(STATE_DIR_ENV) or Path.home() / ".tpuray" / "emulator"
    return Path(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def read_state(path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The running detached cluster's state, or None (a stale file is removed)."""
    file = state_dir(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(int(state.get("pid", -1))):
        file.unlink(missing_ok=True)
        return None
    return state


def up(
    accelerator_type: str,
    topology: str,
    num_slices: int = 1,
    head_cpus: int = 4,
    cpus_per_chip: int = 2,
    path: str | os.PathLike | None = None,
    timeout_s: float = 300.0,
    autoscale: dict[str, Any] | None = None,
    cores: SliceCores = "shared",
    dashboard: bool = True,
) -> dict[str, Any]:
    """Start a detached emulated cluster and return its state once it is ready. `autoscale`:
    {"max_slices": ["TYPE:TOPOLOGY=N", ...], "idle_timeout_s": s} for slices on demand (then
    `num_slices` may be 0); `cores`: EmulatedCluster's; `dashboard`: Ray's dashboard on the head, which
    Ray's own tools (`ray list actors`, `serve status`) need."""
    # Validate before starting anything: the cluster the detached process will start, planned only.
    _planned(accelerator_type, topology, num_slices, head_cpus, cpus_per_chip, autoscale, cores, dashboard)
    directory = state_dir(path)
    running = read_state(directory)
    if running:
        raise RuntimeError(
            f"an emulated cluster is already running at {running['address']} (pid {running['pid']}); "
            "run `tpuray emulate down` first"
        )
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / LOG_FILE
    cmd = [sys.executable, "-m", "tpuray.emulator.detached", "--state-dir", str(directory)]
    cmd += ["--accelerator-type", accelerator_type, "--topology", topology, "--num-slices", str(num_slices)]
    cmd += ["--head-cpus", str(head_cpus), "--cpus-per-chip", str(cpus_per_chip), "--cores", cores]
    cmd += _optional_args(autoscale, dashboard)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(directory)
        if state and state.get("pid") == proc.pid:
            return state
        if proc.poll() is not None:
            tail = log.read_text()[-2000:]
            raise RuntimeError(
                f"emulated cluster failed to start (exit {proc.returncode}); log {log}:\n{tail}"
            )
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError(f"emulated cluster not ready after {timeout_s}s; log: {log}")


def _optional_args(autoscale: dict[str, Any] | None, dashboard: bool) -> list[str]:
    """The detached process's flags for the dashboard and autoscaling."""
    args = ["--dashboard"] if dashboard else []
    if autoscale is not None:
        args += ["--idle-timeout-s", str(autoscale["idle_timeout_s"])]
        args += [f"--max-slices={item}" for item in autoscale["max_slices"]]
    return args


def _planned(
    accelerator_type: str,
    topology: str,
    num_slices: int,
    head_cpus: int,
    cpus_per_chip: int,
    autoscale: dict[str, Any] | None,
    cores: SliceCores,
    dashboard: bool,
) -> Any:
    """The EmulatedCluster `up` starts, planned (ConfigError naming a bad value), not started."""
    from tpuray.emulator.autoscale import parse_max_slices
    from tpuray.emulator.cluster import EmulatedCluster
    from tpuray.emulator.spec import SliceRequest

    check_positive_int("num_slices", num_slices, minimum=0 if autoscale is not None else 1)
    requests = [SliceRequest(accelerator_type, topology, num_slices)] if num_slices else []
    extra: dict[str, Any] = {}
    if autoscale is not None:
        extra = {
            "autoscale": True,
            "max_slices": parse_max_slices(autoscale["max_slices"]),
            "idle_timeout_s": autoscale["idle_timeout_s"],
        }
    return EmulatedCluster(
        requests,
        head_cpus=head_cpus,
        cpus_per_chip=cpus_per_chip,
        cores=cores,
        include_dashboard=dashboard,
        **extra,
    )


def down(path: str | os.PathLike | None = None, timeout_s: float = 120.0) -> dict[str, Any] | None:
    """Stop the detached emulated cluster; returns its last state, or None if none was running."""
    state = read_state(path)
    if state is None:
        return None
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):  # Ray's reaper stops the nodes when their parent dies
        os.kill(pid, signal.SIGKILL)
    (state_dir(path) / STATE_FILE).unlink(missing_ok=True)
    return state


def preempt(
    slice_name: str | None = None,
    node_id: str | None = None,
    notice_s: float = 30.0,
    restore_after_s: float | None = None,
    path: str | os.PathLike | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Ask the running detached cluster to preempt a slice (or one host): see EmulatedCluster.preempt_*.

    The request goes through a file in the state directory; the detached process drains the hosts and
    answers with their node ids and the deadline (UNIX s), then kills them at the deadline itself."""
    if (slice_name is None) == (node_id is None):
        raise ConfigError("preempt needs exactly one of a slice name or a node id")
    state = read_state(path)
    if state is None:
        raise RuntimeError("no emulated TPU cluster is running (start one with `tpuray emulate up`)")
    requests = state_dir(path) / REQUESTS_DIR
    requests.mkdir(exist_ok=True)
    ident = uuid.uuid4().hex
    body = {"slice": slice_name, "node_id": node_id, "notice_s": notice_s, "restore_after_s": restore_after_s}
    tmp = requests / f"{ident}.tmp"
    tmp.write_text(json.dumps(body))
    tmp.replace(requests / f"{ident}.json")
    reply = requests / f"{ident}.reply"
    deadline = time.monotonic() + timeout_s
    while not reply.exists():
        if time.monotonic() > deadline:
            (requests / f"{ident}.json").unlink(missing_ok=True)
            raise TimeoutError(
                f"the emulated cluster (pid {state['pid']}) did not answer within {timeout_s}s"
            )
        time.sleep(0.1)
    answer = json.loads(reply.read_text())
    reply.unlink(missing_ok=True)
    if "error" in answer:
        raise ConfigError(answer["error"])
    return answer


def _answer_requests(cluster: Any, directory: Path) -> None:
    """Carry out preempt requests written by preempt() (each answered in a .reply file)."""
    requests = directory / REQUESTS_DIR
    for file in sorted(requests.glob("*.json")) if requests.is_dir() else []:
        try:
            req = json.loads(file.read_text())
            file.unlink()
        except (OSError, ValueError):
            continue
        try:
            if req.get("slice") is not None:
                p = cluster.preempt_slice(req["slice"], req["notice_s"], req.get("restore_after_s"))
            else:
                p = cluster.preempt_host(req["node_id"], req["notice_s"], req.get("restore_after_s"))
            answer: dict[str, Any] = {"node_ids": p.node_ids, "deadline": p.deadline}
        except Exception as e:  # noqa: BLE001 - the answer carries it to the CLI
            answer = {"error": str(e)}
        tmp = requests / (file.stem + ".reply.tmp")
        tmp.write_text(json.dumps(answer))
        tmp.replace(requests / (file.stem + ".reply"))


def _state(cluster: Any) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "emulated": True,
        "address": cluster.address,
        "dashboard": cluster.dashboard_url,
        "description": cluster.describe(),
        "autoscale": cluster.autoscale.describe() if cluster.autoscale is not None else None,
        "ray_pids": cluster.pids(),
        "slices": [
            {
                "name": s.name,
                "accelerator_type": s.topology.generation.accelerator_type,
                "topology": s.topology.topology,
                "pod_type": s.topology.pod_type,
                "hosts": s.topology.num_hosts,
                "chips_per_host": s.topology.chips_per_host,
                "node_ids": list(s.node_ids),
                "cores": list(s.cores),
            }
            for s in cluster.slices
        ],
    }


def _write_state(directory: Path, state: dict[str, Any]) -> None:
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(directory / STATE_FILE)


def _serve(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    directory = Path(args.state_dir)
    stop = threading.Event()
    autoscale = None
    if args.max_slices:
        autoscale = {"max_slices": args.max_slices, "idle_timeout_s": args.idle_timeout_s}
    cluster = _planned(
        args.accelerator_type,
        args.topology,
        args.num_slices,
        args.head_cpus,
        args.cpus_per_chip,
        autoscale,
        args.cores,
        args.dashboard,
    )
    with cluster:
        # After start: Ray's node start installs its own SIGTERM handler; ours shuts down cleanly.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        state = {**_state(cluster), "started": time.time()}
        _write_state(directory, state)
        print(f"{cluster!r} ready", flush=True)
        hosts = [list(s.node_ids) for s in cluster.slices]
        while not stop.wait(0.2):
            _answer_requests(cluster, directory)
            if [list(s.node_ids) for s in cluster.slices] != hosts:  # a preempted host came back
                hosts = [list(s.node_ids) for s in cluster.slices]
                state = {**_state(cluster), "started": state["started"]}
                _write_state(directory, state)
        print("stopping emulated cluster", flush=True)
    (directory / STATE_FILE).unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="run a detached emulated TPU cluster (used by `tpuray emulate up`)"
    )
    p.add_argument("--state-dir", required=True)
    p.add_argument("--accelerator-type", required=True)
    p.add_argument("--topology", required=True)
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument("--head-cpus", type=int, default=4)
    p.add_argument("--cpus-per-chip", type=int, default=2)
    p.add_argument("--cores", default="shared")
    p.add_argument("--dashboard", action="store_true")
    p.add_argument("--max-slices", action="append", default=None)
    p.add_argument("--idle-timeout-s", type=float, default=60.0)
    return _serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
