"""Helpers for runtime tests: every check runs in a fresh Python process, because registering the
emulated device renames PyTorch's PrivateUse1 key for the rest of a process's life (the pytest process
itself stays untouched)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_python(
    code: str | None = None,
    *,
    args: list[str] | None = None,
    emulation: bool = True,
    timeout: float = 300,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TPURAY_EMULATION", "TPU_VISIBLE_CHIPS")}
    if emulation:
        env["TPURAY_EMULATION"] = "1"
    for name, value in (extra_env or {}).items():
        if name == "PYTHONPATH" and env.get(name):  # in front of this process's path (a checkout's src)
            value = os.pathsep.join((value, env[name]))
        env[name] = value
    cmd = [sys.executable, "-W", "ignore"] + (["-c", textwrap.dedent(code)] if code is not None else args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}")
    return proc
