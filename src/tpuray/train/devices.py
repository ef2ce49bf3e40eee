"""`get_device()` / `get_devices()`: the torch device of this worker (re-exported by `tpuray.train.torch`).

Worker-side and Ray-less: it reads the running session's context, or the process's own accelerator
outside a session (a TPU VM's single process)."""

from __future__ import annotations

import torch

from tpuray.train.session import current_session


def _local_device_type() -> str:
    """Outside a training session: "tpu" where this process has a usable tpu device (a real TorchTPU,
    or tpuray's emulation once active), else "cuda" where a GPU is visible, else "cpu"."""
    accel = getattr(torch, "accelerator", None)  # torch_tpu answers through torch.accelerator only
    if accel is not None and accel.is_available():
        current = accel.current_accelerator()
        if current is not None and current.type in ("tpu", "cuda"):
            return current.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_device() -> torch.device:
    """torch.device("tpu") on TPU workers, cuda:0 (the GPU Ray isolated) on GPU workers, else cpu.
    Outside a training session: the local accelerator (see `_local_device_type`)."""
    sess = current_session()
    kind = sess.context.device_type if sess is not None else _local_device_type()
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    return torch.device(kind)


def get_devices() -> list[torch.device]:
    return [get_device()]
