"""The ``tpu`` device and ``tpu_dist`` collectives backend.

* On a Cloud TPU VM with TorchTPU (``pip install 'tpuray[tpu]'``), ``torch_tpu`` provides both through
  its own ``torch.backends`` entry point; tpuray never emulates there.
* On an emulated TPU host (``TPURAY_EMULATION=1``, set by ``tpuray emulate`` on every emulated node),
  :mod:`tpuray.runtime.autoload` registers an emulated ``tpu`` device (CPU memory, PrivateUse1 renamed
  to "tpu") and an emulated ``tpu_dist`` backend (gloo on the same memory) at ``import torch``.
* Anywhere else, ``tpu_dist`` is registered as a stub whose error explains how to get one.

This module stays cheap to import: torch is imported only by the functions that need it.
"""

from __future__ import annotations

import logging
import os
import sys

from tpuray.constants import EMULATION_ENV

log = logging.getLogger("tpuray.runtime")

_mode: str | None = None  # "emulated" | "real" once activated


def activate() -> str:
    """Make ``torch.device("tpu")`` and ``backend="tpu_dist"`` usable in this process.

    Uses a real TorchTPU when it is usable here; otherwise registers the CPU emulation (and sets
    ``TPURAY_EMULATION=1`` so that processes started from this one emulate too). Returns ``"real"`` or
    ``"emulated"``. Safe to call more than once.
    """
    global _mode
    if _mode is not None:
        return _mode
    from tpuray.runtime.detect import emulation_blocked_reason, host_transfer_hint, torch_tpu_usable

    if torch_tpu_usable():
        import torch_tpu  # noqa: F401  (registers "tpu" and "tpu_dist" itself)

        hint = host_transfer_hint(os.environ)
        if hint:
            log.warning("tpuray: %s", hint)
        _mode = "real"
        return _mode
    blocked = emulation_blocked_reason()
    if blocked and "torch_tpu" in sys.modules:  # its kernels are loaded (autoload was on at import torch)
        raise RuntimeError(blocked)
    os.environ[EMULATION_ENV] = "1"
    _register_emulation()
    return "emulated"


def is_emulated() -> bool:
    """Whether this process runs the emulated tpu device."""
    return _mode == "emulated"


def _activate_from_autoload() -> None:
    """Entry-point path: TPURAY_EMULATION=1 is set; emulate unless a real TorchTPU is usable."""
    from tpuray.runtime.detect import emulation_blocked_reason, torch_tpu_usable

    if torch_tpu_usable():
        log.info("tpuray: real TorchTPU found; not emulating the tpu device")
        return
    blocked = emulation_blocked_reason()
    if blocked:  # torch_tpu's entry point loads its kernels in this same `import torch`
        log.error("tpuray: %s=1 but the tpu device is NOT emulated: %s", EMULATION_ENV, blocked)
        _register_stub(force=True)
        return
    _register_emulation()


def _register_stub(force: bool = False) -> None:
    """Entry-point path without emulation: a tpu_dist whose error says how to get a real one. Left to
    torch_tpu where it is installed (it registers tpu_dist itself where chips exist), unless `force`."""
    from tpuray.runtime.detect import torch_tpu_installed

    if torch_tpu_installed() and not force:
        return
    import torch.distributed as dist

    if dist.is_available():
        from tpuray.runtime.stub import register_stub

        register_stub()


def _register_emulation() -> None:
    global _mode
    if _mode == "emulated":
        return
    import torch
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from tpuray.runtime import device, device_module

    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", device.DEVICE_TYPE):
        raise RuntimeError(
            f"cannot emulate the tpu device: PyTorch's PrivateUse1 backend is already taken by {name!r}"
        )
    if name == "privateuseone":
        _setup_privateuseone_for_python_backend(device.DEVICE_TYPE, backend_module=device_module)
    device.register_kernels()
    from tpuray.runtime.autocast import register_autocast

    register_autocast()

    import torch.distributed as dist

    if dist.is_available():
        from tpuray.runtime import ddp
        from tpuray.runtime.dist import register_backend

        register_backend()
        ddp.install()  # DDP on the tpu device: no c10d "Time stats ..." warning per process
    _mode = "emulated"
    log.info(
        "tpuray: the 'tpu' device and 'tpu_dist' backend are EMULATED on CPU in this process "
        "(%s=1); no TPU hardware is used",
        EMULATION_ENV,
    )
