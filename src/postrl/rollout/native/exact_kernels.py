"""``rollout.exact``'s kernels: the engine computes through :mod:`postrl.models.invariant` and
:func:`postrl.models.exact_layer.decoder_layer`, the operations the trainer's exact forward runs,
with the residual stream in float32 and the projections in the engine's dtype. Every attention is
one closure over the cache (which holds float32 K/V, whole key blocks long)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from postrl.models import invariant, invariant_attention
from postrl.models.exact_layer import LayerShape, LayerWeights, decoder_layer
from postrl.rollout.native.kernels import LayerAttend, PrefillLayout
from postrl.rollout.native.kv_cache import KVCache

if TYPE_CHECKING:
    from postrl.rollout.native.weights import NativeWeights


def exact_attention(cache: KVCache, sequence: torch.Tensor, position: torch.Tensor) -> LayerAttend:
    """Attention of token ``t`` over positions ``0 .. position[t]`` of cache slot ``sequence[t]``,
    through the batch-invariant kernel (the cache holds the pass's own K/V already)."""
    items = invariant_attention.query_items(sequence, position)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return invariant_attention.attention(q, cache.k[layer], cache.v[layer], items)

    return attend


class ExactKernels:
    """Batch-invariant kernels on the plain weights, packed as the trainer packs its own."""

    def __init__(self, model: NativeWeights) -> None:
        self.model = model
        cfg = model.cfg
        self.shape = LayerShape(cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.eps)
        self.rotary = invariant.RotaryTable(model.inv_freq, model.attention_scaling)
        self.layers: list[LayerWeights] = []
        self.head_packed: torch.Tensor | None = None

    def prepare(self, head_written: bool) -> None:
        m = self.model
        self.layers = [
            LayerWeights(
                m.ln1[i],
                m.wqkv[i],
                m.bqkv[i] if m.bqkv is not None else None,
                invariant.pack(m.wqkv[i]),
                m.wo[i],
                invariant.pack(m.wo[i]),
                m.ln2[i],
                m.w_gate_up[i],
                invariant.pack(m.w_gate_up[i]),
                m.w_down[i],
                invariant.pack(m.w_down[i]),
            )
            for i in range(m.cfg.layers)
        ]
        self.head_packed = invariant.pack(m.lm_head)

    def check_adapters(self, names: list[str]) -> None:
        if names:
            raise ValueError("rollout.exact does not support LoRA adapters (the exact forward has no adapter path)")

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        write_slots: torch.Tensor,
        attend: LayerAttend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        m = self.model
        x = F.embedding(tokens, m.embed).float()
        cos, sin = self.rotary(positions)
        for i, weights in enumerate(self.layers):

            def cached_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int = i) -> torch.Tensor:
                cache.write(i, write_slots, positions, k, v)
                return attend(i, q, k, v)

            x = decoder_layer(x, weights, self.shape, cos, sin, cached_attend)
        if logits_rows is not None:
            x = x[logits_rows]
        return invariant.logits(invariant.rms_norm(x, m.final_norm, m.cfg.eps), m.lm_head, self.head_packed)

    def cache_dtype(self) -> torch.dtype:
        """float32: the attention reads K/V in float32, converted once when written."""
        return torch.float32

    def cache_length(self, length: int) -> int:
        """Whole key blocks, so that the attention reads each block as a view."""
        return -(-length // invariant_attention.KEY_BLOCK) * invariant_attention.KEY_BLOCK

    def decode_attention(self, cache: KVCache, hi: int, attended: torch.Tensor) -> LayerAttend:
        return exact_attention(cache, torch.arange(hi, device=attended.device), attended)

    def prefill_attention(self, cache: KVCache, layout: PrefillLayout) -> LayerAttend:
        return exact_attention(cache, layout.slots[layout.row], layout.positions)

    def sequence_attention(self, cache: KVCache, length: int) -> LayerAttend:
        positions = torch.arange(length, device=cache.k[0].device)
        return exact_attention(cache, torch.zeros_like(positions), positions)

    def sampled_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """The trainer's computation of the same quantity, tile by tile."""
        return invariant.token_logprobs(logits, tokens, temperature or 1.0)
