"""tpuray apps under Ray Serve settings that must be in the environment of every Ray process:
the experimental direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: replicas serve HTTP themselves, no
proxy) and the proxy talking to replicas over gRPC (RAY_SERVE_PROXY_USE_GRPC=1). Each runs in a fresh
process with its own small emulated cluster (tests/serve/_serve_env_app.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("setting", ["RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_PROXY_USE_GRPC"])
def test_one_model_app_serves_under_setting(setting: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("_serve_env_app.py")
    env = dict(os.environ, **{setting: "1"})
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(script), setting, str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
