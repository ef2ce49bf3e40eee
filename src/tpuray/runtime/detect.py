"""Is a real TorchTPU (``torch_tpu``) usable in this process's environment?

``import torch_tpu`` initialises libtpu and, where that fails hard, can take the process down, so the
probe imports it in a subprocess, and only when the package is installed at all. The probe costs a few
seconds (torch_tpu loads libtpu), so its answer is passed down to child processes in
``TPURAY_TORCH_TPU_USABLE`` (the emulator sets it on every emulated host).

torch_tpu installed where no TPU chip is usable (a CPU machine after ``pip install 'tpuray[tpu]'``) is a
dead end for emulation: torch_tpu's own ``torch.backends`` entry point loads its C++ kernels for
PyTorch's PrivateUse1 device at every ``import torch``, so a ``tpu`` tensor would run torch_tpu's
kernels (which look for TPU hardware and, on a CPU machine, block) instead of tpuray's. tpuray then
refuses to emulate and says why (:func:`emulation_blocked_reason`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tpuray.constants import (
    EMULATION_ENV,
    TORCH_TPU_PROBE_ENV,
    TPU_HOST_TRANSFER_ENV,
    TPU_PREMAPPED_BUFFER_SIZE_ENV,
)

PROBE_ENV = TORCH_TPU_PROBE_ENV  # "1" / "0": the probe's answer, inherited from a parent process

_PROBE = (
    "import torch, torch_tpu; import torch.distributed as dist; assert 'TPU_DIST' in dist.Backend._plugins"
)


# tpuray's emulated torch_tpu (for Ray's own TPU code on emulated hosts): never a real TorchTPU.
SHIM_DIR = Path(__file__).resolve().parents[1] / "emulator" / "torch_tpu_shim"


def torch_tpu_installed() -> bool:
    """Whether a real ``torch_tpu`` package is importable (without importing it); tpuray's emulated
    torch_tpu (SHIM_DIR, on the import path of emulated hosts) does not count."""
    try:
        spec = importlib.util.find_spec("torch_tpu")
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return spec is not None
    return not Path(spec.origin).resolve().is_relative_to(SHIM_DIR)


@functools.cache
def torch_tpu_usable(timeout_s: float = 120.0) -> bool:
    """Whether torch_tpu imports and registers ``tpu_dist`` here (probed once, in a subprocess, unless
    ``TPURAY_TORCH_TPU_USABLE`` already holds the answer)."""
    if not torch_tpu_installed():
        return False
    inherited = os.environ.get(PROBE_ENV)
    if inherited in ("0", "1"):
        return inherited == "1"
    env = {k: v for k, v in os.environ.items() if k != EMULATION_ENV}
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


def emulation_blocked_reason() -> str | None:
    """Why the emulated ``tpu`` device cannot work in this Python environment, or None when it can."""
    if not torch_tpu_installed() or torch_tpu_usable():
        return None
    return (
        "torch_tpu is installed in this Python environment but no TPU chip is usable here, and its "
        "torch.backends entry point loads its kernels for PyTorch's PrivateUse1 ('tpu') device at every "
        "`import torch`, so tpuray cannot emulate the tpu device next to it (tpu tensors would go to "
        "torch_tpu's kernels, which look for TPU hardware and can block). To emulate on this machine use "
        "an environment without torch_tpu (`pip uninstall torch_tpu libtpu`); on a Cloud TPU VM, "
        "torch_tpu is used and nothing is emulated"
    )


def host_transfer_hint(environ: Mapping[str, str]) -> str | None:
    """What to set where libtpu's premapped host buffer is off in `environ` (a real TorchTPU's process
    environment; torch_tpu read it at `import torch`), or None where it is a positive number of bytes."""
    size = environ.get(TPU_PREMAPPED_BUFFER_SIZE_ENV, "").strip()
    if size.isdigit() and int(size) > 0:
        return None
    settings = " ".join(f"{k}={v}" for k, v in TPU_HOST_TRANSFER_ENV)
    state = "unset" if not size else f"{size!r}, not a positive number of bytes"
    return (
        f"{TPU_PREMAPPED_BUFFER_SIZE_ENV} is {state}: libtpu has no premapped host buffer, so every "
        "host-to-chip copy (weights, KV cache, RL updates) takes its slow staged path (docs/configuration.md). "
        f"Set {settings} in the environment before torch is imported (tpu-vm/env.sh does; tpuray's KubeRay "
        "manifests do where worker_memory leaves room; elsewhere, in the host's environment)"
    )
