"""Helpers shared by test modules (tests/ is on sys.path: `from _util import free_port`)."""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

# ScalingConfig kwargs of a tpuray.train trainer of 2 workers x 2 chips on one emulated v6e 2x2 slice: for
# tests whose checks do not depend on one process per chip (half the worker processes to start on 2 cores)
TWO_WORKERS_V6E_2X2 = {
    "num_workers": 2,
    "use_tpu": True,
    "topology": "2x2",
    "accelerator_type": "TPU-V6E",
    "resources_per_worker": {"TPU": 2},
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the socket is closed again on return)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_placement_groups() -> dict[str, dict]:
    """The connected cluster's placement groups that are not REMOVED, by id ({} when not connected)."""
    import ray

    if not ray.is_initialized():
        return {}
    table = ray.util.placement_group_table()
    return {pg_id: info for pg_id, info in table.items() if info.get("state") != "REMOVED"}


def new_placement_groups(before: set[str] | dict, timeout_s: float = 30.0) -> dict[str, dict]:
    """Live placement groups not in `before`, once none is left or `timeout_s` has passed (removal is an
    asynchronous GCS update): {} when every placement group made since `before` was released."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {k: v for k, v in live_placement_groups().items() if k not in before}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def live_processes(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """Those of `pids` still running (zombies count as ended) once none is or `timeout_s` has passed: []
    when every process exited (a killed actor's process exits asynchronously)."""
    import psutil

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in pids if running(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def read_ranks(out_dir) -> list[dict]:
    """The rank*.json documents a train loop dumped into `out_dir` (tests/train/_loops.py), by rank."""
    import glob
    import json
    import os

    docs = [json.load(open(p)) for p in glob.glob(os.path.join(out_dir, "rank*.json"))]
    return sorted(docs, key=lambda d: d["rank"])


def alive_actors(class_name: str) -> list:
    """The connected cluster's actors of `class_name` (a substring of the class name) that are not DEAD."""
    import ray._private.state as state

    return [a for a in state.actors().values() if a["State"] != "DEAD" and class_name in a["ActorClassName"]]


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Start fn() in a daemon thread; its result, or the exception it raised, lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - the caller checks
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


WITHOUT_TORCH_TPU = pytest.mark.skipif(
    importlib.util.find_spec("torch_tpu") is not None,
    reason="torch_tpu is installed: tests/real_tpu cover it on the chip",
)
"""For tests of tpuray's handling of torch_tpu through a stand-in (stand_in_module) or of its absence."""


def stand_in_module(monkeypatch: Any, name: str, **attributes: Any) -> ModuleType:
    """A module `name` (e.g. one of torch_tpu's, which exists only with torch_tpu) holding `attributes`,
    importable for the test's length: fresh packages above it, each the attribute of its parent."""
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]), ModuleType(".".join(parts[:depth])))
    for depth in range(1, len(parts)):
        setattr(sys.modules[".".join(parts[:depth])], parts[depth], sys.modules[".".join(parts[: depth + 1])])
    module = sys.modules[name]
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


# A compiled ModelRunner started in a child process (a "start" of the embedded engine's runner): builds or
# loads its step programs (tpuray.serve.llm.engine.embedded.programs), runs a greedy prefill and 8 decode
# steps of two prompts (of the tiny model at the path, built there first if missing), prints one JSON line: programs compiled and loaded, and the greedy tokens.
RUNNER_START = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING)
logging.getLogger("tpuray").setLevel(logging.INFO)  # the warm-up's progress, one line per program
from tpuray.serve.llm.engine.embedded.runner import ModelRunner
from tpuray.serve.llm.engine.embedded.step_plan import Buckets
path, device, backend, load_workers, async_compile = *sys.argv[1:4], int(sys.argv[4]), sys.argv[5] == "1"
if not os.path.exists(os.path.join(path, "config.json")):  # built here: on a TPU VM one process holds the chip
    from tpuray.models import build_tiny_causal_lm
    build_tiny_causal_lm(path, max_position_embeddings=512)
buckets = Buckets(batch=(1, 2), tokens=(16,), context=(64,), prefill_seqs=2)
r = ModelRunner(path, max_num_seqs=2, max_model_len=64, device=device, compile=True, compile_backend=backend,
                buckets=buckets, load_workers=load_workers, async_compile=async_compile)
warm = r.warmup()
rows, tokens = [(0, [5, 6, 7, 8], 0, None), (1, [9, 10, 11], 0, None)], []
for i in range(9):
    tokens.append(r.step(rows, need_logits=False).token_ids)
    rows = [(0, [tokens[-1][0]], 4 + i, None), (1, [tokens[-1][1]], 3 + i, None)]
print("START " + json.dumps({"warmup_compiled": warm, "compiled": r.compilations, "loaded": r.loaded_programs,
                             "preloaded": r.programs.preloaded, "programs": buckets.num_programs, "tokens": tokens}))
"""


def runner_start(
    model_dir: str,
    cache,
    device: str,
    backend: str,
    load_workers: int = 1,
    async_compile: bool = False,
    timeout_s: float = 600,
) -> dict:
    """RUNNER_START in a fresh process with TPURAY_COMPILE_CACHE=`cache` (and torch's own compile caches in
    `cache`-torch, TORCHINDUCTOR_CACHE_DIR): its JSON line as a dict."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TPURAY_COMPILE_CACHE=str(cache), TORCHINDUCTOR_CACHE_DIR=f"{cache}-torch")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            RUNNER_START,
            model_dir,
            device,
            backend,
            str(load_workers),
            str(int(async_compile)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0 and "START " in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
    result = json.loads(out.stdout.split("START ", 1)[1].splitlines()[0])
    result["stderr"] = out.stderr
    return result
