"""Autograd functions that keep less for their backward than autograd would, with the forward's
operations unchanged: the lean forward (:mod:`postrl.train.lean_forward`) and the exact one
(:mod:`postrl.models.invariant`, whose values must stay those of its plain operations) share them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class RMSNorm(torch.autograd.Function):
    """``x / rms(x) * weight``, computed in float32 (float64 for float64) and returned in ``out``,
    keeping only ``x`` in ``out`` and the per-token ``1 / rms`` for the backward. Under bf16
    autocast the residual stream ``x`` is float32, as in the transformers model, and the norm hands
    the projections the bf16 they multiply in; its backward reads the bf16 rounding of ``x`` (the
    forward is exact, the backward's ``x / rms`` is rounded to bf16 once) and returns float32 to
    the stream. Autograd through ``F.rms_norm`` on the CPU (a composite there) would keep two
    float32 copies of every norm's input, 4 ``[tokens, hidden]`` float32 tensors per layer. The
    forward's operations are the composite's, so in float32 the values are bit-identical; the
    backward is the same formula in float32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            ctx.save_for_backward(x.to(out), weight, rstd)
            ctx.x_dtype = x.dtype
            return (xf * rstd * weight).to(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype
        normed, g = x.to(acc) * rstd, grad.to(acc)
        g_normed = g * weight.to(acc)
        grad_x = rstd * (g_normed - normed * (g_normed * normed).mean(-1, keepdim=True))
        grad_w = (g * normed).reshape(-1, normed.shape[-1]).sum(0)
        return grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype), None, None


class SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` keeping only ``gate`` and ``up`` for the backward (autograd would also
    keep ``silu(gate)``, one more ``[tokens, intermediate]`` tensor per layer); the backward
    recomputes ``silu(gate)`` and applies the same operations autograd would, so the gradients are
    bit-identical to ``F.silu(gate) * up``'s."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)
