"""Slot-based KV cache: one preallocated slot of `max_model_len` positions per running sequence.

Layout, one tensor per layer for K and one for V: [num_slots + 1, max_model_len, local_kv_heads, head_dim].
Under tensor parallelism each rank holds only its own KV heads. The scheduler hands out slot ids
0..num_slots-1; the extra last slot (`trash_slot`) takes the writes of padding tokens, so that a padded,
fixed-shape step writes every row without branching on which rows are real (what XLA needs: no
data-dependent shapes). The cache itself never allocates after construction.
"""

from __future__ import annotations

import torch


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

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions [0, length) for each slot: [B, heads, length, head_dim]."""
        k = self.k[layer][slots, :length].transpose(1, 2)
        v = self.v[layer][slots, :length].transpose(1, 2)
        return k, v
