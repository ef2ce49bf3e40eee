"""tpuray apps under Ray Serve settings that must be in the environment of every Ray process:
the experimental direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: replicas serve HTTP themselves, no
proxy) and the proxy talking to replicas over gRPC (RAY_SERVE_PROXY_USE_GRPC=1). Each runs in a fresh
process with its own small emulated cluster (tests/serve/_serve_env_app.py); the two processes run at
the same time (each mostly waits: for its cluster's nodes, for Serve's deploy loop)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _util import free_port

SETTINGS = ["RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_PROXY_USE_GRPC"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Both settings' processes, started together: {setting: (exit code, stdout + stderr)}."""
    script = Path(__file__).with_name("_serve_env_app.py")
    logs = tmp_path_factory.mktemp("serve-env")
    procs = {}
    for setting in SETTINGS:
        env = dict(os.environ, **{setting: "1"})
        # Serve's shutdown waits this long for a direct-ingress replica to drain (default 30 s; the
        # cluster goes right after): not what is tested here
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "1"
        env.pop("RAY_ADDRESS", None)
        out = open(logs / f"{setting}.log", "w+")  # a file, not a pipe: nobody reads while both run
        cmd = [sys.executable, str(script), setting, str(free_port()), tiny_model_dir]
        procs[setting] = (
            subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True),
            out,
        )
    results = {}
    try:
        for setting, (proc, out) in procs.items():
            code = proc.wait(timeout=400)
            out.seek(0)
            results[setting] = (code, out.read())
    finally:
        for proc, out in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
    return results


@pytest.mark.parametrize("setting", SETTINGS)
def test_one_model_app_serves_under_setting(runs, setting: str) -> None:
    code, output = runs[setting]
    assert code == 0 and output.strip().endswith("OK"), output[-6000:]
