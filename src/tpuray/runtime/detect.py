"""Is a real TorchTPU (``torch_tpu``) usable in this process's environment?

``import torch_tpu`` aborts the whole process (a C++ CHECK, not an ImportError) when libtpu is missing,
so the probe imports it in a subprocess, and only when the package is installed at all.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

_PROBE = (
    "import torch, torch_tpu; import torch.distributed as dist; assert 'TPU_DIST' in dist.Backend._plugins"
)


def torch_tpu_installed() -> bool:
    """Whether the ``torch_tpu`` package is importable (without importing it)."""
    try:
        return importlib.util.find_spec("torch_tpu") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def torch_tpu_usable(timeout_s: float = 120.0) -> bool:
    """Whether torch_tpu imports and registers ``tpu_dist`` here (probed once, in a subprocess)."""
    if not torch_tpu_installed():
        return False
    env = {k: v for k, v in os.environ.items() if k != "TPURAY_EMULATION"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0
