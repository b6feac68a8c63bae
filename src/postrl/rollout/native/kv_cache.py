"""A preallocated KV cache: one fixed ``[slots, kv_heads, max_len, head_dim]`` block per layer.

Allocated once per engine (grown only if a request needs more slots or length); a sequence owns
a slot for its lifetime and writes its K/V at its positions. No per-token reallocation.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.max_len = slots, max_len

    def fits(self, slots: int, max_len: int) -> bool:
        return slots <= self.slots and max_len <= self.max_len

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v`` are ``[T, kv_heads, head_dim]``; token t goes to ``[slots[t], :, positions[t]]``."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def copy_prefix(self, src: int, dst: torch.Tensor, length: int) -> None:
        """Share a prompt's K/V: copy slot ``src``'s first ``length`` positions into slots ``dst``."""
        for kl, vl in zip(self.k, self.v):
            kl[dst, :, :length] = kl[src, :, :length]
            vl[dst, :, :length] = vl[src, :, :length]
