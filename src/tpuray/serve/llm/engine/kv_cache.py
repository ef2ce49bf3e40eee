"""Slot-based KV cache: one preallocated slot of `max_model_len` positions per running sequence.

Layout per layer: [max_num_seqs, local_kv_heads, max_model_len, head_dim]. Under tensor parallelism each
rank holds only its own KV heads. The scheduler hands out slot ids; the cache itself never allocates.
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
        shape = (num_layers, num_slots, num_kv_heads, max_model_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_model_len = max_model_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """Store k/v [N, heads, head_dim] of N tokens at (slots[i], positions[i])."""
        self.k[layer, slots, :, positions] = k
        self.v[layer, slots, :, positions] = v

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions [0, length) for each slot: [B, heads, length, head_dim]."""
        return self.k[layer, slots, :, :length], self.v[layer, slots, :, :length]
