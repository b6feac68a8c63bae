"""Logprobs and entropy of chosen tokens straight from hidden states, in chunks of rows.

The vocabulary projection of every response token as one ``[N, V]`` float32 tensor (and its
softmax, and their gradients) is the largest allocation of a training step: 1024 tokens over a
49k vocabulary are 200 MB, four times over in the backward; 150k-vocabulary models triple it.
:class:`ChunkedTokenLogprobs` projects ``rows_per_chunk`` rows at a time, keeps only each row's
log-normaliser, and recomputes a chunk's logits in the backward, so the peak is one chunk's
logits whatever N is. Values and gradients equal the unchunked computation's up to rounding.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)

Entropy = Literal["off", "value", "grad"]  # none; its value (no gradient); a term of the loss
CHUNK_ELEMENTS = 1 << 25  # float32 logits per chunk: 128 MB
KEPT_PROBS_ELEMENTS = 1 << 27  # half-precision probabilities kept for the backward: 256 MB


def softmax_stats(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp of targets, entropy)`` in float32 and the probabilities in ``z``'s dtype, from
    half-precision logits ``z [rows, V]``. Compiled (:func:`fused_softmax_stats`) it is one pass
    over ``z`` that materialises nothing in float32; eagerly, several."""
    zf = z.float()
    top = zf.amax(-1, keepdim=True)
    e = torch.exp(zf - top)
    total = e.sum(-1, keepdim=True)
    lse = top + torch.log(total)
    p = e / total
    entropy = lse.squeeze(-1) - (p * zf).sum(-1)
    logp = zf.gather(-1, targets[:, None]).squeeze(-1) - lse.squeeze(-1)
    return logp, entropy, p.to(z.dtype)


_compile_failed = False


@functools.cache
def _compiled_stats() -> Callable:
    return torch.compile(softmax_stats, dynamic=True)


def fused_softmax_stats(
    z: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`softmax_stats` compiled once per process (torch.compile; Inductor caches the kernel
    on disk, so a later process loads it); None where it cannot compile (no compiler, no Triton),
    after one warning: the caller then takes the eager path."""
    global _compile_failed
    if _compile_failed:
        return None
    try:
        return _compiled_stats()(z, targets)
    except Exception as error:  # any compiler failure: the eager path computes the same
        _compile_failed = True
        log.warning(
            "the fused head could not be compiled (%s: %s); using eager operations", type(error).__name__, error
        )
        return None


def rows_per_chunk(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab_size))


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's where it is on (the projection then runs as it would under it)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """The chunk's logits / T: in the projection's dtype at T = 1 (the softmaxes read bf16 and
    compute in float32 themselves, which saves a cast pass), else float32 (or float64)."""
    logits = hidden @ weight.t()
    if temperature == 1.0:
        return logits
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits.div_(temperature)


def _float(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(logp [N], entropy [N])`` of ``targets`` under ``softmax(hidden @ weight.T / T)``.

    Each chunk's elementwise work is a few fused passes (a softmax, an in-place product), since
    on [rows, vocab] tensors the passes, not the matmuls, are the cost."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, fused):
        dtype = _compute_dtype(hidden)
        h, w = hidden.to(dtype), weight.to(dtype)
        out = _float(dtype)
        logp = torch.empty(h.shape[0], dtype=out, device=h.device)
        entropy = torch.empty_like(logp) if with_entropy else None
        lse = torch.empty_like(logp)
        # fused: half-precision logits at T = 1 (an entropy without gradient): one compiled pass
        # per chunk; where a gradient is needed and the probabilities fit KEPT_PROBS_ELEMENTS the
        # backward reuses them instead of recomputing the logits (else it takes the eager path)
        fast = fused and temperature == 1.0 and dtype in (torch.float16, torch.bfloat16)
        keep = fast and any(ctx.needs_input_grad[:2]) and h.shape[0] * w.shape[0] <= KEPT_PROBS_ELEMENTS
        probs = torch.empty(h.shape[0], w.shape[0], dtype=dtype, device=h.device) if keep else None
        chunk = h.shape[0] if keep else chunk  # no float32 logits to bound: one pass, one matmul each way
        for s in range(0, h.shape[0], chunk):
            rows = slice(s, s + chunk)
            z = _chunk_logits(h[rows], w, temperature)
            stats = (
                fused_softmax_stats(z, targets[rows]) if fast and (keep or not any(ctx.needs_input_grad[:2])) else None
            )
            if stats is not None:
                logp[rows], ent, p = stats
                if probs is not None:
                    probs[rows] = p
                if entropy is not None:
                    entropy[rows] = ent
                continue
            probs = None
            log_p = torch.log_softmax(z, dim=-1, dtype=out)
            lse[rows] = z[:, 0].to(out) - log_p[:, 0]
            logp[rows] = log_p.gather(-1, targets[rows, None]).squeeze(-1)
            if entropy is not None:
                entropy[rows] = -(torch.exp(log_p).mul_(log_p)).sum(-1)
        kept = probs if probs is not None else lse
        ctx.keeps_probs = probs is not None
        # the projection in its matmul dtype, kept (not cast again in the backward: 21 ms for SmolLM2's head)
        ctx.save_for_backward(hidden, w, targets, lse, entropy if entropy is not None else lse, kept)
        ctx.weight_dtype = weight.dtype
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.dtype = temperature, chunk, with_entropy, dtype
        ctx.set_materialize_grads(False)  # an output nobody differentiates (entropy) costs nothing
        return logp, (entropy if entropy is not None else torch.zeros_like(logp))

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, w, targets, lse, entropy, probs = ctx.saved_tensors
        grads = head_gradients(
            HeadSaved(hidden.to(ctx.dtype), w, targets, lse, entropy, probs if ctx.keeps_probs else None),
            grad_logp,
            grad_entropy if ctx.with_entropy else None,
            ctx.temperature,
            ctx.chunk,
            ctx.needs_input_grad[:2],
        )
        grad_hidden = grads[0].to(hidden.dtype) if grads[0] is not None else None
        grad_weight = grads[1].to(ctx.weight_dtype) if grads[1] is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


@dataclass(frozen=True)
class HeadSaved:
    """What a head's forward keeps for :func:`head_gradients`: the hidden states and the projection
    in the matmul dtype, the targets, each row's log-normaliser and entropy (of ``logits / T``),
    and the probabilities where they were kept (T = 1, no entropy gradient)."""

    h: torch.Tensor
    w: torch.Tensor
    targets: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    probs: torch.Tensor | None


def head_gradients(
    saved: HeadSaved,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    chunk: int,
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients at ``h`` and at ``w`` (summed over chunks in float32, or float64) of
    ``sum g_logp * logp + g_entropy * entropy``: from the kept probabilities, or from each chunk's
    logits recomputed."""
    h, w, targets, lse = saved.h, saved.w, saved.targets, saved.lse
    accumulate = _float(h.dtype)
    if saved.probs is not None:
        g = (grad_logp if grad_logp is not None else torch.zeros_like(lse)).to(accumulate)
        return _kept_probs_grads(saved.probs, h, w, targets, g, needs)
    grad_h = torch.empty_like(h) if needs[0] else None
    grad_w: torch.Tensor | None = None
    # z = logits / T: the chain rule's 1/T folded into the per-row factors
    g_logp = (grad_logp if grad_logp is not None else torch.zeros_like(lse)) / temperature
    g_entropy = grad_entropy / temperature if grad_entropy is not None else None
    for s in range(0, h.shape[0], chunk):
        rows = slice(s, s + chunk)
        z = _chunk_logits(h[rows], w, temperature)
        g_ent = g_entropy[rows] if g_entropy is not None else None
        dz = _recomputed_dz(z, lse[rows], saved.entropy[rows], g_logp[rows], g_ent, accumulate)
        picked = (torch.arange(dz.shape[0], device=dz.device), targets[rows])  # one target per row
        dz[picked] = dz[picked] + g_logp[rows].to(dz.dtype)  # (scatter_add_ copies a bf16 dz twice)
        dz = dz.to(h.dtype)
        if grad_h is not None:
            grad_h[rows] = dz @ w
        if needs[1]:
            part = (dz.t() @ h[rows]).to(accumulate)
            grad_w = part if grad_w is None else grad_w.add_(part)
    return grad_h, grad_w


def _kept_probs_grads(
    probs: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    g: torch.Tensor,
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients at ``h`` and ``w`` of ``sum g * logp`` from the kept probabilities ``P [N, V]``:
    with ``dz = g ([j == t] - P)`` (T = 1, no entropy gradient), ``dz @ w = g (w_t - P @ w)`` and
    ``dz^T @ h = onehot^T (g h) - P^T (g h)``. The per-row factor ``g`` multiplies the small
    ``[N, H]`` side, so no ``[N, V]`` gradient is written (a pass of 46 ms over SmolLM2's 1024 x 49k
    probabilities), and the target terms are ``[N, H]`` gathers and an ``index_add_``."""
    grad_h = grad_w = None
    if needs[0]:
        grad_h = (w[targets].to(g.dtype) - (probs @ w).to(g.dtype)) * g[:, None]
    if needs[1]:
        gh = h.to(g.dtype) * g[:, None]
        grad_w = (probs.t() @ gh.to(probs.dtype)).to(g.dtype).neg_()
        grad_w.index_add_(0, targets, gh)
    return grad_h, grad_w


def _recomputed_dz(z, lse, entropy, g_logp, g_entropy, accumulate: torch.dtype) -> torch.Tensor:
    """A chunk's gradient at the logits but for the target term, from its recomputed logits.
    d logp_t / d z_j = [j == t] - p_j;  d H / d z_j = -p_j (log p_j + H). Without the entropy
    term, dz = -p g in the matmul dtype: the product is rounded to it before the matmuls anyway."""
    if g_entropy is None:
        return torch.softmax(z, dim=-1).mul_(-g_logp[:, None].to(z.dtype))
    p = torch.softmax(z, dim=-1, dtype=accumulate)
    coef = z.to(accumulate).sub_(lse[:, None]).add_(entropy[:, None]).mul_(g_entropy[:, None])
    return p.mul_(coef.add_(g_logp[:, None])).neg_()


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: Entropy = "off",
    chunk: int | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[N]`` (and entropy ``[N]``: with ``with_entropy="grad"`` it carries a gradient) of
    ``targets [N]`` given ``hidden [N, H]`` and the output projection ``weight [V, H]``. ``fused``:
    in half precision (the lean forward asks for it), the compiled single-pass softmax (:func:`fused_softmax_stats`) where it applies."""
    chunk = chunk or rows_per_chunk(weight.shape[0])
    fused = fused and with_entropy != "grad"
    wanted = with_entropy != "off"
    logp, entropy = ChunkedTokenLogprobs.apply(hidden, weight, targets, temperature, chunk, wanted, fused)
    if not wanted:
        return logp, None
    return logp, entropy if with_entropy == "grad" else entropy.detach()
