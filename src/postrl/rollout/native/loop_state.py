"""What a decode loop works on, owned by the native engine and handed to each loop it starts.

The engine keeps its model, its KV cache, the kept caches, its random generator and counters here;
a :class:`~postrl.rollout.native.decode_loop.DecodeLoop` reads and grows them, and reaches the
engine's weights only through :class:`WeightSlot` (the version it holds, and weights that arrived
during the loop swapped in between two steps)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from postrl.rollout.native.kv_cache import KeptCaches, KVCache
from postrl.rollout.native.model import NativeCausalLM


class WeightSlot(Protocol):
    """The engine's weights, as a loop sees them."""

    weight_version: int

    def apply_pending_weights(self) -> bool:
        """Swap in weights that arrived during the loop; True when there were some."""
        ...


@dataclass
class LoopState:
    model: NativeCausalLM
    tokenizer: Any
    eos: frozenset[int]
    generator: torch.Generator
    weights: WeightSlot
    kept: KeptCaches  # finished sequences' K/V by Prompt.cache_key
    max_batch_size: int = 256
    max_prefill_tokens: int = 2048
    cache_reuse_ratio: float = 2.0
    kv_after_update: str = "keep"  # or "recompute": K/V computed by older weights is not reused
    stats: dict[str, float] = field(
        default_factory=lambda: {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0}
    )
    suspending: threading.Event = field(default_factory=threading.Event)  # set: the loop returns what it has
    cache: KVCache | None = None
    slots_hint: int = 0  # slots of the last loop: the next one starts with as many
    updates_in_flight: int = 0  # weight updates applied in the middle of a generate

    def ensure_cache(self, slots: int, max_len: int) -> KVCache:
        """Reuse the cache across calls when it fits and is at most ``cache_reuse_ratio`` times too long
        (decode attends over its whole length); otherwise allocate it once for this call. An exact
        engine's length is whole key blocks, so that its attention reads each block as a view."""
        max_len = self.model.kernels.cache_length(max_len)
        old = self.cache
        if old is not None and old.fits(slots, max_len) and old.max_len <= self.cache_reuse_ratio * max_len:
            return old
        slots = max(slots, old.slots if old else 0)
        cfg = self.model.cfg
        self.cache = None  # the old one is freed before the new one is allocated
        self.cache = KVCache(
            cfg.layers, slots, cfg.kv_heads, max_len, cfg.head_dim, self.model.kernels.cache_dtype(), self.model.device
        )
        return self.cache
