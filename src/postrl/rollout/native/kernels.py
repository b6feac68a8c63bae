"""How the native engine computes: one set of kernels, chosen once when the engine is built.

:class:`~postrl.rollout.native.fast_kernels.FastKernels` is the fastest the device allows (oneDNN
prepacked weights on CPUs that pack bf16, masked batched matmuls for decode, SDPA for prefill).
:class:`~postrl.rollout.native.exact_kernels.ExactKernels` is ``rollout.exact``: every operation
batch-invariant and the same as the trainer's exact forward, so the engine's logprobs equal the
trainer's bit for bit. Everything that differs between the two (the layer stack, the weights'
packing, the three attentions, the cache's dtype and length, the sampled tokens' logprobs, LoRA)
is a method here, so nothing else in the engine asks which mode it runs in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from postrl.rollout.native.kv_cache import KVCache

# (layer, queries [T, heads, head_dim], keys, values [T, kv_heads, head_dim]) -> [T, heads * head_dim]
LayerAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillLayout:
    """Tokens of several sequences packed without padding: token ``t`` is at column ``col[t]`` of
    item ``row[t]``, whose tokens start at position ``first[row]`` of cache slot ``slots[row]``;
    ``lengths[i]`` tokens are new for item ``i``, ``totals[i]`` its whole length."""

    slots: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    first: torch.Tensor
    lengths: list[int]
    totals: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.first[self.row] + self.col


class Kernels(Protocol):
    """What the engine's model, decode loop and sequence scoring ask of the mode they compute in."""

    def prepare(self, head_written: bool) -> None:
        """After every load: the weights as the kernels multiply by them (``head_written``: the
        output projection changed)."""

    def check_adapters(self, names: list[str]) -> None:
        """Raise when these LoRA adapter tensors cannot be served (before any is written)."""

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        write_slots: torch.Tensor,
        attend: LayerAttend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """Float32 logits of ``logits_rows`` (all when None) after the layers and the head."""

    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype."""

    def cache_length(self, length: int) -> int:
        """The cache length to allocate for sequences of up to ``length`` positions."""

    def decode_attention(self, cache: KVCache, hi: int, attended: torch.Tensor) -> LayerAttend:
        """Attention of slot ``s`` < ``hi`` (one query each) over its positions ``0 .. attended[s]``."""

    def prefill_attention(self, cache: KVCache, layout: PrefillLayout) -> LayerAttend:
        """Attention of packed prompt tokens over their slots' caches, causally."""

    def sequence_attention(self, cache: KVCache, length: int) -> LayerAttend:
        """Causal attention of one sequence of ``length`` tokens in slot 0."""

    def sampled_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """The logprobs recorded for the sampled ``tokens`` (``logprobs``: the sampler's)."""
