"""`shutdown_serve` stops Ray Serve without the error line `serve.shutdown()` makes Ray print on every
clean shutdown ("Task ServeController.graceful_shutdown failed ... killed by `ray.kill`")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import time, ray
    from ray import serve
    from tpuray.serve.shutdown import shutdown_serve
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"port": 0})
    shutdown_serve()
    time.sleep(2)  # Ray's error listener prints asynchronously
    print("serve running after:", ray.util.list_named_actors(all_namespaces=True))
    ray.shutdown()
    """
)


@pytest.mark.full(
    "CI: every tests/serve run ends its Serve instance with shutdown_serve (tests/serve/conftest.py); this "
    "starts a Ray of its own to read what a clean shutdown prints"
)
def test_a_clean_serve_shutdown_prints_no_error() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "serve running after: []" in proc.stdout
    assert "graceful_shutdown failed" not in proc.stdout + proc.stderr
    assert "Error" not in proc.stderr, proc.stderr[-3000:]
