"""A staged tensor that is still its row blocks: what a rollout rank's join (a part's rows from several
trainer ranks) and fuse (q/k/v -> qkv, gate/up -> gate_up) describe, without copying them. The commit
copies each block straight into its rows of the engine's weight: one copy of the received bytes where the
join, the fuse and the commit made up to three (benchmarks/README.md, "Staged as row blocks"). On a
chip too: each block is one host-to-chip copy into a row view of the weight.

The blocks are views of the buffers the update was received into (`tpuray.rl.weights.buffers`), valid until
the next update; an update is committed or discarded before the next one is received, so they hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Rows:
    """A tensor of `shape` (dim 0 stacked from `blocks`: (first row, tensor) in row order, each of
    `shape[1:]`) that nothing has copied together yet. It answers what staging and its checks ask of a
    tensor (shape, dtype, numel, element_size, is_floating_point); `copy_into` writes it."""

    def __init__(self, blocks: Sequence[tuple[int, torch.Tensor]]) -> None:
        if not blocks:
            raise ValueError("Rows needs at least one block")
        first = blocks[0][1]
        self.blocks = list(blocks)
        self.dtype: torch.dtype = first.dtype
        self.shape = torch.Size((sum(t.shape[0] for _, t in blocks), *first.shape[1:]))

    @classmethod
    def stack(cls, tensors: Sequence[torch.Tensor | Rows]) -> Rows:
        """`torch.cat(tensors)` along dim 0, as blocks (a `Rows` among them gives its own blocks)."""
        blocks: list[tuple[int, torch.Tensor]] = []
        row = 0
        for t in tensors:
            inner = t.blocks if isinstance(t, Rows) else [(0, t)]
            blocks.extend((row + start, b) for start, b in inner)
            row += t.shape[0]
        return cls(blocks)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return all(t.is_floating_point() for _, t in self.blocks)

    def detach(self) -> Rows:
        return self

    def copy_into(self, dest: torch.Tensor) -> None:
        """Write every block into its rows of `dest` (cast to its dtype), in place: on the host, the
        emulated device and a real chip alike (each block one host-to-chip copy into a row view there,
        `tests/real_tpu/test_weight_pieces.py`)."""
        for start, t in self.blocks:
            dest[start : start + t.shape[0]].copy_(t)

    def materialize(self) -> torch.Tensor:
        """A tensor of its own holding the rows (on the host)."""
        return torch.cat([t for _, t in self.blocks]).to(self.dtype)

    def __repr__(self) -> str:
        return f"Rows(shape={tuple(self.shape)}, dtype={self.dtype}, blocks={len(self.blocks)})"


def owned(t: torch.Tensor | Rows) -> torch.Tensor:
    """A host copy of `t` that shares no storage (a staged tensor kept past the next update)."""
    return t.materialize() if isinstance(t, Rows) else t.detach().to("cpu", copy=True)


def write(dest: torch.Tensor, t: torch.Tensor | Rows) -> None:
    """`dest.copy_(t)` for a tensor or `Rows`."""
    if isinstance(t, Rows):
        t.copy_into(dest)
    else:
        dest.copy_(t)
