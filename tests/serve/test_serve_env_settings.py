"""tpuray apps under Ray Serve settings that must be in the environment of every Ray process: the
experimental direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: replicas serve HTTP themselves) and the
proxy talking to replicas over gRPC (RAY_SERVE_PROXY_USE_GRPC=1). Both are set in one fresh process with its
own small emulated cluster (tests/serve/_serve_env_app.py): the proxy still runs under direct ingress, so
one app is driven through the replica's own port and through the proxy (over gRPC)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _util import free_port


@pytest.mark.full(
    "CI: the same app through Serve's default HTTP proxy (serve/test_serve_openai.py); Serve's direct ingress "
    "and gRPC proxy are Ray settings tpuray passes through"
)
def test_one_model_app_serves_under_direct_ingress_and_the_grpc_proxy(tiny_model_dir) -> None:
    script = Path(__file__).with_name("_serve_env_app.py")
    env = dict(os.environ, RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_PROXY_USE_GRPC="1")
    # Serve's shutdown waits this long for a direct-ingress replica to drain (default 30 s; the cluster
    # goes right after): not what is tested here
    env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "1"
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, str(script), str(free_port()), tiny_model_dir]
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400
    )
    output = proc.stdout
    assert proc.returncode == 0 and output.strip().endswith("OK"), output[-6000:]
    assert "direct ingress OK: http://127.0.0.1:30" in output and "proxy over gRPC OK" in output, output[
        -6000:
    ]
