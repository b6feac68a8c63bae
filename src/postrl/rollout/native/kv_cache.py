"""A preallocated KV cache: one fixed ``[slots, kv_heads, max_len, head_dim]`` block per layer.

Allocated once per engine (grown only if a request needs more slots or length); a sequence owns
a slot for its lifetime and writes its K/V at its positions. No per-token reallocation.
:class:`KeptCaches` holds finished sequences' K/V between calls, for multi-turn episodes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

MIN_SHARED_PREFIX = 8  # shorter common prefixes are not worth a separate prefill pass


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Longest common prefix of the prompts, leaving at least one token of each to prefill."""
    if len(prompts) < 2:
        return 0
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


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
        self.slots = slots
        self.max_len = max_len

    def fits(self, slots: int, max_len: int) -> bool:
        return slots <= self.slots and max_len <= self.max_len

    def resized(self, slots: int, max_len: int) -> KVCache:
        """A cache of ``slots`` x ``max_len`` (each at least this one's) holding this one's contents."""
        k0 = self.k[0]
        bigger = KVCache(len(self.k), slots, k0.shape[1], max_len, k0.shape[3], k0.dtype, k0.device)
        for new, old in zip((*bigger.k, *bigger.v), (*self.k, *self.v)):
            new[: self.slots, :, : self.max_len] = old
        return bigger

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v`` are ``[T, kv_heads, head_dim]``; token t goes to ``[slots[t], :, positions[t]]``
        (in the cache's dtype: an exact engine keeps float32 K/V of its bf16 projections)."""
        self.k[layer][slots, :, positions] = k.to(self.k[layer].dtype)
        self.v[layer][slots, :, positions] = v.to(self.v[layer].dtype)

    def copy_prefix(self, src: int, dst: torch.Tensor, length: int) -> None:
        """Share a prompt's K/V: copy slot ``src``'s first ``length`` positions into slots ``dst``."""
        for kl, vl in zip(self.k, self.v):
            kl[dst, :, :length] = kl[src, :, :length]
            vl[dst, :, :length] = vl[src, :, :length]

    def move(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy slots ``src``' first ``length`` positions into slots ``dst`` (a sequence moves)."""
        for kl, vl in zip(self.k, self.v):
            kl[dst, :, :length] = kl[src, :, :length]
            vl[dst, :, :length] = vl[src, :, :length]

    def restore(self, slot: int, kept: KeptKV) -> None:
        """Put a kept sequence's K/V back into ``slot`` (its positions ``[0, len(kept.ids))``)."""
        n = len(kept.ids)
        for kl, vl, k, v in zip(self.k, self.v, kept.k, kept.v):
            kl[slot, :, :n] = k
            vl[slot, :, :n] = v


@dataclass
class KeptKV:
    """A finished sequence's K/V, kept for the next call that extends it (a multi-turn episode)."""

    ids: list[int]
    k: list[torch.Tensor]  # per layer [kv_heads, len(ids), head_dim]
    v: list[torch.Tensor]
    version: int  # the oldest weights behind it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class KeptCaches:
    """K/V of finished sequences by ``Prompt.cache_key``, least recently kept dropped first once
    they hold more than ``max_bytes``. ``take`` hands one out once (it moves back into a slot)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, KeptKV] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.reused_tokens = 0

    def keep(self, key: str, ids: list[int], cache: KVCache, slot: int, version: int) -> None:
        if self.max_bytes <= 0 or not ids:
            return
        self.drop(key)
        n = len(ids)
        kept = KeptKV(
            list(ids), [k[slot, :, :n].clone() for k in cache.k], [v[slot, :, :n].clone() for v in cache.v], version
        )
        self.entries[key] = kept
        self.bytes += kept.nbytes
        while self.bytes > self.max_bytes and self.entries:
            self.drop(next(iter(self.entries)))

    def take(self, key: str | None, ids: list[int]) -> KeptKV | None:
        """The kept K/V of ``key`` when its tokens are a proper prefix of ``ids`` (at least one token
        is left to prefill); it leaves the store either way."""
        if key is None or key not in self.entries:
            if key is not None:
                self.misses += 1
            return None
        kept = self.entries[key]
        self.drop(key)
        n = len(kept.ids)
        if n >= len(ids) or ids[:n] != kept.ids:
            self.misses += 1
            return None
        self.hits += 1
        self.reused_tokens += n
        return kept

    def drop(self, key: str) -> None:
        kept = self.entries.pop(key, None)
        if kept is not None:
            self.bytes -= kept.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
