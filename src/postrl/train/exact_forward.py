"""The trainer's half of ``rollout.exact``: logprobs computed exactly as the native engine computes them.

A micro-batch's rows (prompt + one response each, the rows of a group sharing their prompt) run
as one flat list of tokens, each prompt once, through :mod:`postrl.models.invariant`, the
operations the engine's exact forward uses, on the model's parameters rounded to the compute
dtype (the engine holds exactly that rounding). Every token's numbers are then independent of
the micro-batch it is in, so its logprob equals, bit for bit, the one the engine reported when it
sampled it (tested in float32 and bf16). Gradients flow through the same operations (through the
rounding casts to the float32 parameters); with gradient checkpointing on, each layer is recomputed
in the backward, and the head is always recomputed tile by tile (it would keep ``[tokens, vocab]``
float32 logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from postrl.models import invariant
from postrl.train.lean_forward import shared_prompt_groups, supports_lean_forward


def supports_exact_forward(model: torch.nn.Module) -> str | None:
    """None when ``model`` (unwrapped) can run the exact forward; otherwise why not."""
    if not supports_lean_forward(model):
        return "it needs a plain (not sharded) Llama / Qwen2 / Mistral model with the native engine's layers"
    decoder: Any = model.model
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear for m in projections):
            return "it does not support LoRA adapters"
    return None


@dataclass(frozen=True)
class ExactLayout:
    """Rows as flat tokens: token ``t`` is at ``position[t]`` of key row ``sequence[t]`` (a group's
    prompt tokens belong to its first row); ``key_map[r, p]`` is the flat token at position ``p``
    of row ``r`` (``T``, a zero row, past its end; the width a multiple of the key block);
    ``predictors[i]`` is the token whose hidden state predicts the i-th response token (row-major)."""

    tokens: torch.Tensor
    position: torch.Tensor
    sequence: torch.Tensor
    key_map: torch.Tensor
    predictors: torch.Tensor


def exact_layout(input_ids: torch.Tensor, spans: list[tuple[int, int]], group_ids: torch.Tensor | None) -> ExactLayout:
    """The layout of rows that are prompt + one response (``spans``: each row's (prompt length,
    response length)), rows of a ``group_ids`` entry sharing their prompt (checked)."""
    ids = input_ids.tolist()
    rows = len(ids)
    width = -(-max(p + n for p, n in spans) // invariant.KEY_BLOCK) * invariant.KEY_BLOCK
    tokens: list[int] = []
    position: list[int] = []
    sequence: list[int] = []
    key_rows: list[list[int]] = [[] for _ in range(rows)]
    response_start: dict[int, int] = {}
    prompt_end: dict[int, int] = {}
    for members in shared_prompt_groups(input_ids, spans, group_ids).values():
        lead, p = members[0], spans[members[0]][0]
        prompt = list(range(len(tokens), len(tokens) + p))
        tokens += ids[lead][:p]
        position += range(p)
        sequence += [lead] * p
        for row in members:
            n = spans[row][1]
            response_start[row], prompt_end[row] = len(tokens), prompt[-1]
            key_rows[row] = prompt + list(range(len(tokens), len(tokens) + n))
            tokens += ids[row][p : p + n]
            position += range(p, p + n)
            sequence += [row] * n
    total = len(tokens)
    key_map = torch.full((rows, width), total, dtype=torch.long)
    for row, keys in enumerate(key_rows):
        key_map[row, : len(keys)] = torch.tensor(keys)
    predictors: list[int] = []
    for row in range(rows):
        first = response_start[row]
        predictors += [prompt_end[row]] + list(range(first, first + spans[row][1] - 1))
    device = input_ids.device
    as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return ExactLayout(
        as_tensor(tokens), as_tensor(position), as_tensor(sequence), key_map.to(device), as_tensor(predictors)
    )


class ExactForward:
    """Per-token logprobs of a Llama-family model through the engine's exact operations."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner: Any = model  # a transformers Llama-family model: its submodules are reached by name
        cfg = inner.config
        self.model = inner
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        rotary = inner.model.rotary_emb
        self.rotary = invariant.RotaryTable(rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)))

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 under bf16 autocast, else the parameters' dtype: the dtype the engine must hold."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        dtype: torch.dtype = self.model.model.embed_tokens.weight.dtype
        return dtype

    def token_logprobs(
        self, layout: ExactLayout, targets: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob (and entropy) of each response token ``targets`` (row-major, as ``predictors``)."""
        device = layout.tokens.device
        dtype = self.compute_dtype(device)
        with torch.autocast(device.type, enabled=False):
            # index_select, not indexing: a group's first response tokens share their predictor, and
            # the backward of indexing sums repeated rows in a thread-timing-dependent order
            hidden = self._hidden(layout, dtype).index_select(0, layout.predictors)
            head = self.model.get_output_embeddings().weight.to(dtype)
            logp, entropy = [], []
            for h, tok in zip(*_tiles(hidden, targets), strict=True):
                out = checkpoint(_head_tile, h, head, tok, temperature, with_entropy, use_reentrant=False)
                logp.append(out[0])
                entropy.append(out[1])
            n = len(targets)
            return torch.cat(logp)[:n], torch.cat(entropy)[:n] if with_entropy else None

    def _hidden(self, layout: ExactLayout, dtype: torch.dtype) -> torch.Tensor:
        decoder = self.model.model
        x = F.embedding(layout.tokens, decoder.embed_tokens.weight.to(dtype)).float()
        cos, sin = self.rotary(layout.position)
        items = invariant.query_items(layout.sequence, layout.position)
        use_checkpoint = bool(decoder.gradient_checkpointing) and torch.is_grad_enabled()
        for layer in decoder.layers:
            if use_checkpoint:
                x = checkpoint(self._layer, layer, x, cos, sin, layout, items, dtype, use_reentrant=False)
            else:
                x = self._layer(layer, x, cos, sin, layout, items, dtype)
        return invariant.rms_norm(x, decoder.norm.weight.to(dtype), self.eps)

    def _layer(
        self, layer, x, cos, sin, layout: ExactLayout, items: invariant.QueryItems, dtype: torch.dtype
    ) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        d, nh, nkv = self.head_dim, self.heads, self.kv_heads
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        wqkv = torch.cat([m.weight for m in projections]).to(dtype)  # the engine's fused q|k|v
        bqkv = torch.cat([m.bias for m in projections]).to(dtype) if attn.q_proj.bias is not None else None
        h = invariant.rms_norm(x, layer.input_layernorm.weight.to(dtype), self.eps)
        qkv = invariant.linear(h, wqkv, bqkv)
        q = invariant.rotate(qkv[:, : nh * d].view(-1, nh, d), cos, sin)
        k = invariant.rotate(qkv[:, nh * d : (nh + nkv) * d].view(-1, nkv, d), cos, sin)
        v = qkv[:, (nh + nkv) * d :].view(-1, nkv, d)
        keys, values = _key_store(k, layout.key_map), _key_store(v, layout.key_map)
        out = invariant.attention(q, keys, values, items)
        x = x + invariant.linear(out, attn.o_proj.weight.to(dtype)).float()
        h = invariant.rms_norm(x, layer.post_attention_layernorm.weight.to(dtype), self.eps)
        gate_up = invariant.linear(h, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).to(dtype))
        return x + invariant.linear(invariant.silu_mul(gate_up), mlp.down_proj.weight.to(dtype)).float()


def _key_store(k: torch.Tensor, key_map: torch.Tensor) -> torch.Tensor:
    """``[rows, kv_heads, width, head_dim]``: each row's keys by position (a KV cache's layout)."""
    padded = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
    rows, width = key_map.shape
    return padded.index_select(0, key_map.reshape(-1)).view(rows, width, *k.shape[1:]).transpose(1, 2)


def _tiles(*rows: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    n = rows[0].shape[0]
    pad = (-n) % invariant.TILE_ROWS
    padded = [torch.cat([r, r.new_zeros(pad, *r.shape[1:])]) for r in rows]
    return [p.split(invariant.TILE_ROWS) for p in padded]


def _head_tile(
    h: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's logprobs (as :func:`postrl.models.invariant.logits` then
    :func:`~postrl.models.invariant.token_logprobs` compute them) and entropies (zeros without)."""
    log_p = torch.log_softmax(F.linear(h, head).float() / temperature, dim=-1)
    logp = log_p.gather(-1, tokens[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else torch.zeros_like(logp)
    return logp, entropy
