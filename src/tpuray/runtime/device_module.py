"""``torch.tpu`` for the emulated device: the cuda-style module API code written for TorchTPU expects.

Each process sees the chips listed in ``TPU_VISIBLE_CHIPS`` (Ray sets one chip per worker), numbered
from 0 like ``CUDA_VISIBLE_DEVICES``. Random numbers for the emulated device come from the CPU
generator, so the seeding functions seed that one.
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager

import torch

# Ops on the emulated device run eagerly on the calling thread, so streams and events are no-ops;
# torch.cpu's dummies have the cuda-style surface (FSDP2 uses Stream, stream(), record_event()).
from torch.cpu import Event, Stream, StreamContext, current_stream, stream  # noqa: F401

from tpuray.constants import TPU_ACCELERATOR_TYPE_ENV, TPU_VISIBLE_CHIPS_ENV

EMULATED = True
_current = 0


def _visible_chips() -> list[str]:
    raw = os.environ.get(TPU_VISIBLE_CHIPS_ENV, "").strip()
    return [c for c in raw.split(",") if c.strip()] if raw else []


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """Number of chips this process sees (``TPU_VISIBLE_CHIPS``; 1 when unset)."""
    return max(1, len(_visible_chips()))


def current_device() -> int:
    return _current


def _index(device: torch.device | str | int | None) -> int:
    if device is None:
        return _current
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "tpu":
        raise ValueError(f"expected a tpu device, got {dev}")
    return _current if dev.index is None else dev.index


def set_device(device: torch.device | str | int) -> None:
    global _current
    idx = _index(device)
    if not 0 <= idx < device_count():
        raise ValueError(
            f"tpu device index {idx} is out of range: this process sees {device_count()} chip(s) "
            f"({TPU_VISIBLE_CHIPS_ENV}={os.environ.get(TPU_VISIBLE_CHIPS_ENV, '<unset>')!r})"
        )
    _current = idx


@contextmanager
def device(dev: torch.device | str | int | None):
    """Context manager selecting the current tpu device."""
    global _current
    prev = _current
    if dev is not None:
        set_device(dev)
    try:
        yield
    finally:
        _current = prev


def synchronize(device: torch.device | str | int | None = None) -> None:
    """Ops on the emulated device run eagerly on CPU: nothing to wait for."""


def default_stream(device: torch.device | str | int | None = None) -> Stream:
    return current_stream()


def set_stream(s: Stream) -> None:
    """Streams are no-ops on the emulated device."""


def get_device_name(device: torch.device | str | int | None = None) -> str:
    accel = os.environ.get(TPU_ACCELERATOR_TYPE_ENV, "TPU")
    return f"{accel} (emulated on CPU)"


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def seed_all() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device: torch.device | str | int = "tpu") -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: torch.device | str | int = "tpu") -> None:
    torch.set_rng_state(new_state)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported() -> bool:
    return True


def memory_allocated(device: torch.device | str | int | None = None) -> int:
    """Not tracked for the emulated device (tensors live in ordinary CPU memory)."""
    return 0


def empty_cache() -> None:
    """Emulated tensors are ordinary CPU tensors, freed by Python's reference counting."""


class _EmulatedTpuModule(types.ModuleType):
    def __repr__(self) -> str:
        return f"<module 'torch.tpu' (tpuray: EMULATED on CPU, {device_count()} chip(s) visible)>"


sys.modules[__name__].__class__ = _EmulatedTpuModule
