"""tpuray apps behind Ray Serve's experimental direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1).

The variable must be in the environment of every Ray process, so the check runs in a fresh process
with its own small emulated cluster (tests/serve/_direct_ingress_app.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def test_one_model_app_serves_through_direct_ingress():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("_direct_ingress_app.py")
    env = dict(os.environ, RAY_SERVE_ENABLE_DIRECT_INGRESS="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(script), str(port)], env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
