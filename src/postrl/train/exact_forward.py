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
from postrl.train.chunked_head import rows_per_chunk
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
            logp, entropy = ExactHead.apply(hidden, head, targets, temperature, with_entropy)
            return logp, entropy if with_entropy else None

    def _hidden(self, layout: ExactLayout, dtype: torch.dtype) -> torch.Tensor:
        decoder = self.model.model
        embed = decoder.embed_tokens  # its padding_idx row gets no gradient, as in the module's forward
        x = F.embedding(layout.tokens, embed.weight.to(dtype), padding_idx=embed.padding_idx).float()
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
        keys, values = _key_store(k.float(), layout.key_map), _key_store(v.float(), layout.key_map)
        out = invariant.attention(q, keys, values, items)
        x = x + invariant.linear(out, attn.o_proj.weight.to(dtype)).float()
        h = invariant.rms_norm(x, layer.post_attention_layernorm.weight.to(dtype), self.eps)
        gate_up = invariant.linear(h, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).to(dtype))
        return x + invariant.linear(invariant.silu_mul(gate_up), mlp.down_proj.weight.to(dtype)).float()


def _key_store(k: torch.Tensor, key_map: torch.Tensor) -> torch.Tensor:
    """``[rows, kv_heads, width, head_dim]``: each row's keys by position (the engine's exact KV
    cache's layout, and its float32)."""
    padded = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
    rows, width = key_map.shape
    return padded.index_select(0, key_map.reshape(-1)).view(rows, width, *k.shape[1:]).transpose(1, 2)


class ExactHead(torch.autograd.Function):
    """``(logp [N], entropy [N])`` of ``targets`` under ``softmax(hidden @ head.T / T)``: the forward
    tile by tile exactly as the engine computes it (:func:`postrl.models.invariant.logits`, then
    :func:`~postrl.models.invariant.token_logprobs`), keeping no ``[rows, vocab]`` tensor; the
    backward recomputes the logits in chunks of :func:`~postrl.train.chunked_head.rows_per_chunk`
    rows, with one weight-gradient product per chunk (the gradient need not be batch-invariant)."""

    @staticmethod
    def forward(ctx: Any, hidden, head, targets, temperature: float, with_entropy: bool):
        logp, entropy = [], []
        tiles = zip(
            invariant.pad_rows(hidden).split(invariant.TILE_ROWS),
            invariant.pad_rows(targets).split(invariant.TILE_ROWS),
            strict=True,
        )
        packed = invariant.pack(head)
        for h, tok in tiles:
            log_p = torch.log_softmax(invariant.scaled(invariant.head_logits(h, head, packed), temperature), dim=-1)
            logp.append(log_p.gather(-1, tok[:, None])[:, 0])
            entropy.append(-(log_p.exp() * log_p).sum(-1) if with_entropy else log_p.new_zeros(len(tok)))
        n = hidden.shape[0]
        out_logp, out_entropy = torch.cat(logp)[:n], torch.cat(entropy)[:n]
        ctx.save_for_backward(hidden, head, targets, out_entropy)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        ctx.set_materialize_grads(False)
        return out_logp, out_entropy

    @staticmethod
    def backward(ctx: Any, grad_logp, grad_entropy):
        hidden, head, targets, entropy = ctx.saved_tensors
        t = ctx.temperature
        g_logp = (grad_logp if grad_logp is not None else torch.zeros_like(entropy)) / t
        g_entropy = grad_entropy / t if ctx.with_entropy and grad_entropy is not None else None
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w: torch.Tensor | None = None
        chunk = rows_per_chunk(head.shape[0])
        for s in range(0, hidden.shape[0], chunk):
            rows = slice(s, s + chunk)
            log_p = torch.log_softmax(invariant.scaled((hidden[rows] @ head.t()).float(), t), dim=-1)
            p = log_p.exp()
            coef = -g_logp[rows, None]
            if g_entropy is not None:  # d H / d z_j = -p_j (log p_j + H)
                coef = coef - g_entropy[rows, None] * (log_p + entropy[rows, None])
            dz = p * coef
            picked = (torch.arange(dz.shape[0], device=dz.device), targets[rows])
            dz[picked] = dz[picked] + g_logp[rows]
            dz = dz.to(head.dtype)
            if grad_h is not None:
                grad_h[rows] = dz @ head
            if ctx.needs_input_grad[1]:
                part = (dz.t() @ hidden[rows]).float()
                grad_w = part if grad_w is None else grad_w.add_(part)
        return grad_h, None if grad_w is None else grad_w.to(head.dtype), None, None, None
