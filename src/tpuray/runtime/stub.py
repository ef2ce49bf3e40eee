"""The ``tpu_dist`` registered where there is neither a real TorchTPU nor emulation.

``init_process_group(backend="tpu_dist")`` would otherwise fail with torch's bare "Unknown c10d backend
type TPU_DIST"; this stub fails with an explanation of how to get a working one. Kept tiny: it is
imported at every ``import torch``.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from tpuray.constants import EMULATION_ENV

BACKEND_NAME = "tpu_dist"

NOT_AVAILABLE = (
    "torch.distributed backend 'tpu_dist' is not available in this process: it needs either a real "
    "TorchTPU (pip install 'tpuray[tpu]' on a Cloud TPU VM, where torch_tpu registers 'tpu' and "
    "'tpu_dist') or an emulated TPU slice (start one with `tpuray emulate up`, or set "
    f"{EMULATION_ENV}=1 in the environment of every process before importing torch, or call "
    f"tpuray.runtime.activate()). {EMULATION_ENV} is {{state}}; torch_tpu is {{tpu}}."
)


def _not_available(store, rank, size, timeout):
    from tpuray.runtime.detect import emulation_blocked_reason, torch_tpu_installed

    state = repr(os.environ[EMULATION_ENV]) if EMULATION_ENV in os.environ else "unset"
    tpu = (
        "installed but not usable here (no TPU chips or libtpu)" if torch_tpu_installed() else "not installed"
    )
    blocked = emulation_blocked_reason() if os.environ.get(EMULATION_ENV) == "1" else None
    raise RuntimeError(blocked or NOT_AVAILABLE.format(state=state, tpu=tpu))


def register_stub() -> None:
    """Register a ``tpu_dist`` that fails with an explanation (only when nothing else provides one), for
    the tpu device as TorchTPU registers its own."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _not_available, devices=["tpu"])
