"""Exact mode's decoder layer, written once for the engine and the trainer.

The native engine (:class:`postrl.rollout.native.exact_kernels.ExactKernels`) and the
trainer (:class:`postrl.train.exact_forward.ExactForward`) both run :func:`decoder_layer`: the same
:mod:`postrl.models.invariant` operations in the same order, so that their logprobs agree bit for
bit by construction rather than by two copies kept in step. Each side passes the layer's weights as
it holds them (the engine's fused copies, the trainer's rounded ones) and its own attention: the
engine writes the new keys and values into its cache and attends over it, the trainer attends over
the sequence's keys laid out as that cache is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from postrl.models import invariant

# (queries [T, heads, head_dim], keys and values [T, kv_heads, head_dim]) -> [T, heads * head_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerShape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float  # the RMS norms'


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights in the compute dtype: q|k|v fused (and its bias), the output projection,
    gate|up fused, down; each projection with its prepacked form where the CPU has one
    (:func:`postrl.models.invariant.pack`)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_packed: torch.Tensor | None
    out: torch.Tensor
    out_packed: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_packed: torch.Tensor | None
    down: torch.Tensor
    down_packed: torch.Tensor | None


def decoder_layer(
    x: torch.Tensor, w: LayerWeights, shape: LayerShape, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """The residual stream ``x`` (float32, ``[T, hidden]``) after one Llama-family layer: RMS norm,
    the fused q|k|v projection, rotary positions, ``attend``, the output projection, RMS norm, the
    gated MLP; the residual additions in float32."""
    d, nh, nkv = shape.head_dim, shape.heads, shape.kv_heads
    h = invariant.rms_norm(x, w.input_norm, shape.eps)
    qkv = invariant.linear(h, w.qkv, w.qkv_bias, w.qkv_packed)
    q = invariant.rotate(qkv[:, : nh * d].view(-1, nh, d), cos, sin)
    k = invariant.rotate(qkv[:, nh * d : (nh + nkv) * d].view(-1, nkv, d), cos, sin)
    v = qkv[:, (nh + nkv) * d :].view(-1, nkv, d)
    x = x + invariant.linear(attend(q, k, v), w.out, packed=w.out_packed).float()
    h = invariant.rms_norm(x, w.post_norm, shape.eps)
    gate_up = invariant.linear(h, w.gate_up, packed=w.gate_up_packed)
    return x + invariant.linear(invariant.silu_mul(gate_up), w.down, packed=w.down_packed).float()
