"""Host buffers a process keeps and reuses from one weight update to the next (a sync moves the same sizes
every time, and freshly allocated pages cost several times a copy into warm ones: benchmarks/README.md,
"Buffers reused"). A caller must be done with a key's last buffer before it asks for the key again (its
data is overwritten): an update is committed or discarded before the next one is received."""

from __future__ import annotations

import math
from typing import Any

import torch

_BUFFERS: dict[tuple[Any, ...], torch.Tensor] = {}  # this process's, by use


def flat(key: tuple[Any, ...], nbytes: int) -> torch.Tensor:
    """A flat byte buffer of `nbytes` kept under `key` (reused by the next call with that key and size)."""
    b = _BUFFERS.get(key)
    if b is None or b.numel() != nbytes:
        b = _BUFFERS[key] = torch.empty(nbytes, dtype=torch.uint8)
    return b


def like(key: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of `shape` and `dtype` over `flat(key, ...)`."""
    return flat(key, math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
