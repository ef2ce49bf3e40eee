"""Host buffers an owner keeps and reuses from one weight update to the next (a sync moves the same sizes
every time, and freshly allocated pages cost several times a copy into warm ones: benchmarks/README.md,
"Buffers reused"). Each owner has its pool: a trainer rank's packed updates (`tpuray.rl.sync.local`), a
tpu_dist group's received buffers (`tpuray.rl.sync.collective.SyncGroup`), a vLLM worker's sparse parts
(`tpuray.rl.rollout.vllm_worker`). A caller must be done with a key's last buffer before it asks for the
key again (its data is overwritten): an update is committed or discarded before the next one is
received."""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch


class BufferPool:
    """Flat byte buffers by key, reused by the next request of that key and size."""

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}

    def flat(self, key: Hashable, nbytes: int) -> torch.Tensor:
        """A flat byte buffer of `nbytes` kept under `key` (reused by the next call with that key and
        size)."""
        b = self._buffers.get(key)
        if b is None or b.numel() != nbytes:
            b = self._buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
        return b

    def like(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` over `flat(key, ...)`."""
        return self.flat(key, math.prod(shape) * dtype.itemsize).view(dtype).view(shape)

    def clear(self) -> None:
        """Drop every buffer (a view of one stays valid: it keeps its storage)."""
        self._buffers.clear()
