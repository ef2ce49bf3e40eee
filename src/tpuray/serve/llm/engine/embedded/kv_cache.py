"""Slot-based KV cache: one preallocated slot of `max_model_len` positions per running sequence.

Layout, one tensor per layer for K and one for V: [num_slots + 1, max_model_len, local_kv_heads, head_dim].
Under tensor parallelism each rank holds only its own KV heads. The scheduler hands out slot ids
0..num_slots-1; the extra last slot (`trash_slot`) takes the writes of padding tokens, so that a padded,
fixed-shape step writes every row without branching on which rows are real (what XLA needs: no
data-dependent shapes). The cache itself never allocates after construction.

Two ways to store a step's K/V: `write` (a scatter of the rows: what every device does well, except a TPU
at many rows, where XLA's scatter costs ~0.3 ms per decode row of the 1.1B model) and `dense_writer` (the
first `length` positions of every slot rewritten in place through a static slice, the rows placed by a
one-hot matmul: a cost that does not grow with the rows; the decode probe, benchmarks/notes/real-tpu.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DenseWrite = Callable[[int, torch.Tensor, torch.Tensor], None]


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_slots + 1, max_model_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.trash_slot = num_slots
        self.max_model_len = max_model_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k/v [N, heads, head_dim] of N tokens at (slots[i], positions[i]) (fixed N: padding
        tokens point at the trash slot)."""
        self.k[layer].index_put_((slots, positions), k)
        self.v[layer].index_put_((slots, positions), v)

    def dense_writer(self, slots: torch.Tensor, positions: torch.Tensor, length: int) -> DenseWrite:
        """`write(layer, k, v)` for N tokens at (slots[i], positions[i]), every position < `length`, without
        a scatter: positions [0, length) of every slot are rewritten, the N rows placed by a one-hot
        matmul (exact: one non-zero term per element). Rows that share a place (padding in the trash
        slot) add up there."""
        S = self.k[0].shape[0]
        places, onehot = one_hot_places(S, length, slots, positions)
        written = places[..., None, None]

        def put(cache: torch.Tensor, x: torch.Tensor) -> None:
            rows = (onehot.to(x.dtype) @ x.reshape(x.shape[0], -1)).view(S, length, *x.shape[1:])
            cache[:, :length] = torch.where(written, rows, cache[:, :length])

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            put(self.k[layer], k)
            put(self.v[layer], v)

        return write

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions [0, length) for each slot: [B, heads, length, head_dim]."""
        k = self.k[layer][slots, :length].transpose(1, 2)
        v = self.v[layer][slots, :length].transpose(1, 2)
        return k, v


def one_hot_places(
    num_slots: int, length: int, slots: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where N rows land at (slots[i], positions[i]) among `num_slots` x `length` places: (written
    [num_slots, length], whether a row lands there; onehot [num_slots * length, N], which one)."""
    dev = slots.device
    hit = (torch.arange(num_slots, device=dev)[:, None, None] == slots) & (
        torch.arange(length, device=dev)[None, :, None] == positions
    )  # [S, length, N]
    return hit.any(-1), hit.reshape(num_slots * length, -1)
