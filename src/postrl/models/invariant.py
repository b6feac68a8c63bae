"""Batch-invariant operations: a token's numbers do not depend on what it is computed with.

The engine decodes a token one row among whatever else is in flight; the trainer recomputes it
inside a packed micro-batch. Ordinary kernels choose their blocking, their reduction order and
their split across threads from the shapes of the call (on this project's CPUs a float32
``F.linear`` of 1-3 rows rounds differently from one of 4 or more; a bf16 one of 33-512 rows
differently from one of 32), so the same token gets different logprobs on the two sides. Here
every operation that reduces runs on fixed shapes whatever the batch:

- matrix products (projections, the head) run on tiles of exactly :data:`TILE_ROWS` rows, padded
  with zero rows; within a tile, rows are independent and their place in it does not matter
  (measured for 64-256 rows on this CPU, tested at 128; 128 costs about what a 96-row decode step's one product does, and a
  training forward's 1,600 rows take 1.3x one whole product in bf16, 32-row tiles 2.3x);
- row-wise and elementwise work (norms, the gated activation, rotation, log-softmax) runs on all
  rows at once, padded to whole tiles: a row reduction runs over outputs, each row in the same
  order, and the elementwise kernels split the rows at multiples of their vector width;
- attention (:mod:`postrl.models.invariant_attention`) runs in float32 over fixed blocks of
  ``KEY_BLOCK`` key *positions* (block ``b``
  holds positions ``64 b .. 64 b + 63`` of the query's own sequence): queries grouped in items of
  one sequence (16 queries, or one in a decode step), each item's scores one product whose rows and
  columns do not depend on how many share it (tested), the softmax maximum first (exact in any
  order), then each block's ``exp`` sums and probability-weighted values (one fixed-shape product
  per block) added in block order. Keys after a query's position contribute exact zeros, so a query
  reads the same numbers whether its sequence is 10 or 1,000 tokens long in the call;
- rotary angles come from one table by position, computed in fixed chunks of positions.

Each of these is tested against its row computed alone, on this CPU's kernels; a new kernel
library could break one, which the tests of :mod:`tests.test_exact` would show.

The engine (:class:`~postrl.rollout.native.model.NativeCausalLM` with ``exact``) and the trainer
(:mod:`postrl.train.exact_forward`) both compute with these functions and with the same weights
(the trainer's float32 parameters rounded to the compute dtype, as the engine holds them), so a
sampled token's logprob is the same number on both sides, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from postrl.models.lean_ops import RMSNorm, SiluMul

TILE_ROWS = 128
ROPE_CHUNK = 256  # positions per chunk of the rotary table


def fixed_batches(device: torch.device) -> bool:
    """Whether every call must also have a fixed number of rows (of tiles, of attention items): on a
    GPU, whose kernels choose their configuration (and so their reduction order) by the whole shape.
    The CPU's row-wise kernels and batched products treat each row or item alike whatever their
    number (tested), so there they run on everything at once."""
    return device.type != "cpu"


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of :data:`TILE_ROWS`."""
    pad = (-x.shape[0]) % TILE_ROWS
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


def row_tiles(x: torch.Tensor) -> list[torch.Tensor]:
    """``x``'s consecutive :data:`TILE_ROWS`-row tiles, each contiguous (kernels choose their code by
    strides too), the last padded with zero rows: only that one is copied."""
    n = x.shape[0]
    whole = n - n % TILE_ROWS
    tiles = list(x[:whole].split(TILE_ROWS)) if whole else []
    if whole < n:
        tiles.append(pad_rows(x[whole:]))
    return [t.contiguous() for t in tiles]


def by_tiles(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to consecutive :data:`TILE_ROWS`-row tiles of ``rows`` (tensors with the same
    first dimension, split by :func:`row_tiles`), concatenated (one tile: as it is) and cut back."""
    n = rows[0].shape[0]
    tiles = [fn(*parts) for parts in zip(*(row_tiles(r) for r in rows), strict=True)]
    return (tiles[0] if len(tiles) == 1 else torch.cat(tiles))[:n]


def by_rows(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
    """``fn`` of row-wise or elementwise operations, on ``rows`` padded to whole tiles at once: the
    row reductions run over outputs (every row reduced in the same order) and the elementwise kernels
    split the work at multiples of their vector width, so every element takes the same code path
    whatever the number of rows (tested; a matrix product is not like this: :func:`linear`). On a
    GPU, whose reduction kernels pick their configuration from the row count, tile by tile."""
    if fixed_batches(rows[0].device):  # a GPU reduction's kernel configuration follows the row count
        return by_tiles(fn, *rows)
    n = rows[0].shape[0]
    return fn(*(pad_rows(r).contiguous() for r in rows))[:n]


def by_rows_unpadded(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
    """``fn`` of elementwise operations that are each correctly rounded (``+ - * /``, ``sqrt``,
    casts: the vector and the scalar code give the same number, so where a thread's share of the
    elements ends does not matter) and of reductions along a row (each row reduced in the same
    order whatever their number, tested for 1-2,300 rows and widths 48-4,096 on 1 and 2 threads),
    on ``rows`` as they are: the CPU needs no padding for these (:func:`by_rows` pads for ``exp``
    and ``silu``, whose vector and scalar codes differ). On a GPU, :func:`by_rows`."""
    if fixed_batches(rows[0].device):
        return by_rows(fn, *rows)
    return fn(*rows)


@functools.cache
def cpu_packs_bf16() -> bool:
    """oneDNN's bf16 weight packing needs AVX512 (bw, vl, dq) or AVX-NE-CONVERT; a CPU without them
    refuses it."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), TILE_ROWS)
    except RuntimeError:
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` reordered into oneDNN's blocked layout for :data:`TILE_ROWS`-row products, where
    the CPU does that for bf16 (a tile's product then runs ~1.7x faster than ``F.linear``'s, which
    packs on every call; rows stay independent of each other, tested); None elsewhere. The engine
    keeps packed copies; the trainer packs each forward (~60 ms for SmolLM2)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not cpu_packs_bf16():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), TILE_ROWS)


def _product(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(t, packed, bias, "none", [], "")
    return F.linear(t, weight, bias)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b`` in ``weight``'s dtype, one :data:`TILE_ROWS`-row product at a time; ``packed``:
    :func:`pack` of ``weight``, made here when not given."""
    x = x.to(weight.dtype)
    packed = packed if packed is not None else pack(weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return TiledLinear.apply(x, weight, bias, packed)
    return tiled_product(x, weight, bias, packed)


def tiled_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b`` one :data:`TILE_ROWS`-row product at a time. Unpacked, each tile's product is
    written into its rows of one output (``mm`` with ``out``: the same kernel and numbers as
    ``F.linear``, tested), which saves a copy of the whole output; packed, the oneDNN kernel
    returns its own."""
    if packed is not None:
        return by_tiles(lambda t: _product(t, weight, bias, packed), x)
    n = x.shape[0]
    out = x.new_empty(-(-n // TILE_ROWS) * TILE_ROWS, weight.shape[0])
    for i, tile in enumerate(row_tiles(x)):
        rows = out[i * TILE_ROWS : (i + 1) * TILE_ROWS]
        if bias is None:
            torch.mm(tile, weight.t(), out=rows)
        else:
            torch.addmm(bias, tile, weight.t(), out=rows)
    return out[:n]


class TiledLinear(torch.autograd.Function):
    """:func:`linear`'s forward, tile by tile; its backward as whole products (only the forward
    must not depend on the batch): per tile, autograd would add one weight gradient per tile."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return tiled_product(x, weight, bias, packed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the float32 residual stream, returned in ``weight``'s dtype (the projections'); with a
    gradient, through :class:`~postrl.models.lean_ops.RMSNorm` (its forward is these operations)."""

    def norm(t: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (t.requires_grad or weight.requires_grad):  # the same operations
            return RMSNorm.apply(t, weight.float(), eps, weight.dtype)
        return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)

    return by_rows_unpadded(norm, x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[gate | up]`` projection's output."""

    def act(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=-1)
        return SiluMul.apply(gate, up) if torch.is_grad_enabled() and t.requires_grad else F.silu(gate) * up

    return by_rows(act, gate_up)


class RotaryTable:
    """cos and sin of the rotary angles of positions ``0 ..``, computed in float32 chunk by chunk
    (each value by the same vectorised code whatever the positions asked for) and kept."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float) -> None:
        self.inv_freq = inv_freq.float()
        self.scaling = scaling
        self.cos = torch.empty(0, 2 * inv_freq.numel(), device=inv_freq.device)
        self.sin = torch.empty_like(self.cos)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, head_dim]`` cos and sin of ``positions`` (float32)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        while self.cos.shape[0] < need:
            start = self.cos.shape[0]
            chunk = torch.arange(start, start + ROPE_CHUNK, device=self.inv_freq.device).float()
            freqs = chunk[:, None] * self.inv_freq.to(chunk.device)[None]
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos = torch.cat([self.cos, emb.cos() * self.scaling])
            self.sin = torch.cat([self.sin, emb.sin() * self.scaling])
        return self.cos[positions][:, None], self.sin[positions][:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, heads, head_dim]`` in float32, returned in ``x``'s dtype."""

    def turn(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        half = tf.shape[-1] // 2
        return (tf * c + torch.cat([-tf[..., half:], tf[..., :half]], dim=-1) * s).to(t.dtype)

    return by_rows_unpadded(turn, x, cos, sin)


def logits(hidden: torch.Tensor, head: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits of ``hidden`` under the output projection ``head`` ``[vocab, hidden]``."""
    packed = packed if packed is not None else pack(head)
    return by_tiles(lambda t: head_logits(t.to(head.dtype), head, packed), hidden)


def head_logits(tile: torch.Tensor, head: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """One tile's float32 logits (the trainer's head computes its tiles with this too)."""
    return _product(tile, head, None, packed).float()


def scaled(logits_: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``; at 1 the logits themselves (the same numbers, no [rows, vocab] pass)."""
    return logits_ if temperature == 1.0 else logits_ / temperature


def token_logprobs(logits_: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` per row (float32)."""

    def pick(t: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(scaled(t, temperature), dim=-1).gather(-1, tok[:, None])[:, 0]

    return by_rows(pick, logits_, tokens)
