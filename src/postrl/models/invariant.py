"""Batch-invariant operations: a token's numbers do not depend on what it is computed with.

The engine decodes a token one row among whatever else is in flight; the trainer recomputes it
inside a packed micro-batch. Ordinary kernels choose their blocking, their reduction order and
their split across threads from the shapes of the call (on this project's CPUs a float32
``F.linear`` of 1-3 rows rounds differently from one of 4 or more; a bf16 one of 33-512 rows
differently from one of 32), so the same token gets different logprobs on the two sides. Here
every operation that reduces runs on fixed shapes whatever the batch:

- row-local work (projections, norms, the gated activation, the head, log-softmax) runs on tiles
  of exactly :data:`TILE_ROWS` rows, padded with zero rows; within a tile, rows are independent
  and their place in it does not matter (tested);
- attention runs per tile of queries over fixed blocks of :data:`KEY_BLOCK` key *positions*
  (block ``b`` holds positions ``64 b .. 64 b + 63`` of the query's own sequence), in float32:
  the softmax maximum first (exact in any order), then each block's ``exp`` sums and
  probability-weighted values added in block order. Keys after a query's position contribute
  exact zeros, so a query reads the same numbers whether its sequence is 10 or 1,000 tokens long
  in the call;
- rotary angles come from one table by position, computed in fixed chunks of positions.

The engine (:class:`~postrl.rollout.native.model.NativeCausalLM` with ``exact``) and the trainer
(:mod:`postrl.train.exact_forward`) both compute with these functions and with the same weights
(the trainer's float32 parameters rounded to the compute dtype, as the engine holds them), so a
sampled token's logprob is the same number on both sides, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TILE_ROWS = 32
KEY_BLOCK = 64
ROPE_CHUNK = 256  # positions per chunk of the rotary table


def by_tiles(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to consecutive :data:`TILE_ROWS`-row tiles of ``rows`` (tensors with the same
    first dimension; the last tile padded with zero rows; each tile contiguous, since kernels choose
    their code by strides too), concatenated and cut back."""
    n = rows[0].shape[0]
    pad = (-n) % TILE_ROWS
    if pad:
        rows = tuple(torch.cat([r, r.new_zeros(pad, *r.shape[1:])]) for r in rows)
    tiles = [fn(*(p.contiguous() for p in parts)) for parts in zip(*(r.split(TILE_ROWS) for r in rows), strict=True)]
    return torch.cat(tiles)[:n]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` in ``weight``'s dtype, tile by tile."""
    return by_tiles(lambda t: F.linear(t.to(weight.dtype), weight, bias), x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the float32 residual stream, returned in ``weight``'s dtype (the projections')."""

    def norm(t: torch.Tensor) -> torch.Tensor:
        return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)

    return by_tiles(norm, x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[gate | up]`` projection's output."""

    def act(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    return by_tiles(act, gate_up)


class RotaryTable:
    """cos and sin of the rotary angles of positions ``0 ..``, computed in float32 chunk by chunk
    (each value by the same vectorised code whatever the positions asked for) and kept."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float) -> None:
        self.inv_freq, self.scaling = inv_freq.float(), scaling
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
    """Rotary embedding of ``x`` ``[T, heads, head_dim]`` in float32, returned in ``x``'s dtype
    (elementwise: exactly rounded whatever the batch)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)


def attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """Causal attention of queries ``q`` ``[T, heads, head_dim]``: query ``t`` attends to positions
    ``0 .. position[t]`` of sequence ``sequence[t]`` in ``keys``/``values`` ``[S, kv_heads, L,
    head_dim]`` (a KV cache's layout; the query's own key already written). Returns ``[T, heads *
    head_dim]`` in ``q``'s dtype."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = keys.shape[1]
    scale = head_dim**-0.5

    def tile(qt: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        rows = qt.shape[0]
        qf = qt.float().view(rows, kv_heads, heads // kv_heads, head_dim)
        blocks = (int(pos.max()) + KEY_BLOCK) // KEY_BLOCK
        scores, vals = [], []
        for b in range(blocks):
            kb, vb = _block(keys, seq, b), _block(values, seq, b)
            s = torch.matmul(qf, kb.float().transpose(-1, -2)) * scale  # [rows, kv, groups, KEY_BLOCK]
            key_pos = torch.arange(b * KEY_BLOCK, (b + 1) * KEY_BLOCK, device=q.device)
            scores.append(s.masked_fill((key_pos[None] > pos[:, None]).view(rows, 1, 1, -1), float("-inf")))
            vals.append(vb)
        top = scores[0].amax(-1, keepdim=True)
        for s in scores[1:]:
            top = torch.maximum(top, s.amax(-1, keepdim=True))
        total = out = None
        for s, vb in zip(scores, vals, strict=True):
            e = torch.exp(s - top)
            part, weighted = e.sum(-1, keepdim=True), torch.matmul(e, vb.float())
            total = part if total is None else total + part
            out = weighted if out is None else out + weighted
        assert out is not None and total is not None
        return (out / total).to(q.dtype).reshape(rows, heads * head_dim)

    return by_tiles(tile, q, sequence, position)


def _block(store: torch.Tensor, seq: torch.Tensor, b: int) -> torch.Tensor:
    """Positions ``[b * KEY_BLOCK, (b + 1) * KEY_BLOCK)`` of sequences ``seq``: ``[rows, kv_heads,
    KEY_BLOCK, head_dim]``, zero past the store's end (those positions are masked); contiguous
    whatever the store's strides (a matmul's kernel, and so its rounding, depends on them). A gather
    by ``index_select``: the backward of ``store[seq]`` (``index_put_`` accumulating) sums repeated
    rows in an order that varies with thread timing on the CPU; ``index_select``'s does not."""
    part = store[:, :, b * KEY_BLOCK : (b + 1) * KEY_BLOCK].index_select(0, seq)
    short = KEY_BLOCK - part.shape[2]
    return (F.pad(part, (0, 0, 0, short)) if short else part).contiguous()


def logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """float32 logits of ``hidden`` under the output projection ``head`` ``[vocab, hidden]``."""
    return by_tiles(lambda t: F.linear(t.to(head.dtype), head).float(), hidden)


def token_logprobs(logits_: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` per row (float32)."""

    def pick(t: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(t / temperature, dim=-1).gather(-1, tok[:, None])[:, 0]

    return by_tiles(pick, logits_, tokens)
