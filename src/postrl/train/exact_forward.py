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

from postrl.models import invariant, invariant_attention
from postrl.models.exact_layer import LayerShape, LayerWeights, decoder_layer
from postrl.train.chunked_head import KEPT_PROBS_ELEMENTS, HeadSaved, head_gradients, rows_per_chunk
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
    width = -(-max(p + n for p, n in spans) // invariant_attention.KEY_BLOCK) * invariant_attention.KEY_BLOCK
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


class RoundedWeights:
    """The weights the exact forward computes with, kept from one micro-batch to the next: each
    fused (``torch.cat``) and rounded to the compute dtype, with its packed form
    (:func:`postrl.models.invariant.pack`), made again when the weights change: when their owner
    says so (:meth:`at`: the fused AdamW step changes the parameters in place without bumping
    their version), or when a parameter's version moves. A SmolLM2 micro-batch spent a fifth of
    its time casting and packing the same weights again."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[tuple, torch.Tensor, torch.Tensor | None]] = {}
        self.weights_version = 0

    def at(self, weights_version: int) -> None:
        """The parameters are at ``weights_version`` of their owner's count of changes: a new one
        drops every kept copy."""
        if weights_version != self.weights_version:
            self.entries.clear()
            self.weights_version = weights_version

    def get(
        self, name: str, params: tuple[torch.Tensor, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``params`` fused and rounded to ``dtype``, its packed form or None); gradients flow
        back to ``params`` (cast to their dtype)."""
        key = (dtype, *((id(p), p._version) for p in params))
        entry = self.entries.get(name)
        if entry is None or entry[0] != key:
            with torch.no_grad():
                weight = (torch.cat(params) if len(params) > 1 else params[0]).to(dtype)
            entry = (key, weight, invariant.pack(weight) if weight.dim() == 2 else None)
            self.entries[name] = entry
        weight, packed = entry[1], entry[2]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            weight = Rounded.apply(weight, *params)
        return weight, packed


class Rounded(torch.autograd.Function):
    """``weight`` (the parameters fused and rounded, computed before) as a function of the
    parameters: its gradient split among them and cast to their dtype."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [p.shape[0] for p in params]
        ctx.dtypes = [p.dtype for p in params]
        return weight.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        parts = grad.split(ctx.sizes) if len(ctx.sizes) > 1 else (grad,)
        return (None, *(g.to(dtype) for g, dtype in zip(parts, ctx.dtypes, strict=True)))


class ExactForward:
    """Per-token logprobs of a Llama-family model through the engine's exact operations; one per
    model, kept (its :class:`RoundedWeights` last until the parameters change)."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner: Any = model  # a transformers Llama-family model: its submodules are reached by name
        cfg = inner.config
        self.model = inner
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        self.shape = LayerShape(self.heads, self.kv_heads, self.head_dim, self.eps)
        rotary = inner.model.rotary_emb
        self.rotary = invariant.RotaryTable(rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)))
        self.weights = RoundedWeights()

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
            master = self.model.get_output_embeddings().weight
            with torch.no_grad():  # ExactHead gives the master weight its gradient itself
                head, packed = self.weights.get("head", (master,), dtype)
            logp, entropy = ExactHead.apply(hidden, master, head, packed, targets, temperature, with_entropy)
            return logp, entropy if with_entropy else None

    def _hidden(self, layout: ExactLayout, dtype: torch.dtype) -> torch.Tensor:
        decoder = self.model.model
        embed = decoder.embed_tokens  # its padding_idx row gets no gradient, as in the module's forward
        # rows gathered, then rounded: the rounded table's rows, without rounding the whole table
        x = F.embedding(layout.tokens, embed.weight, padding_idx=embed.padding_idx).to(dtype).float()
        cos, sin = self.rotary(layout.position)
        items = invariant_attention.query_items(layout.sequence, layout.position)
        use_checkpoint = bool(decoder.gradient_checkpointing) and torch.is_grad_enabled()
        for i, layer in enumerate(decoder.layers):
            if use_checkpoint:
                x = checkpoint(self._layer, i, layer, x, cos, sin, layout, items, dtype, use_reentrant=False)
            else:
                x = self._layer(i, layer, x, cos, sin, layout, items, dtype)
        return invariant.rms_norm(x, decoder.norm.weight.to(dtype), self.eps)

    def _layer(
        self, i: int, layer, x, cos, sin, layout: ExactLayout, items: invariant_attention.QueryItems, dtype: torch.dtype
    ) -> torch.Tensor:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = _key_store(k.float(), layout.key_map), _key_store(v.float(), layout.key_map)
            return invariant_attention.attention(q, keys, values, items)

        return decoder_layer(x, self._layer_weights(i, layer, dtype), self.shape, cos, sin, attend)

    def _layer_weights(self, i: int, layer, dtype: torch.dtype) -> LayerWeights:
        """Layer ``i``'s weights rounded to ``dtype`` (kept until the parameters change), q|k|v and
        gate|up fused as the engine holds them."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        wqkv, packed_qkv = self.weights.get(f"{i}.qkv", tuple(m.weight for m in projections), dtype)
        bqkv = None
        if attn.q_proj.bias is not None:
            bqkv, _ = self.weights.get(f"{i}.qkv.bias", tuple(m.bias for m in projections), dtype)
        wo, packed_o = self.weights.get(f"{i}.o", (attn.o_proj.weight,), dtype)
        w_gate_up, packed_gate_up = self.weights.get(f"{i}.gate_up", (mlp.gate_proj.weight, mlp.up_proj.weight), dtype)
        w_down, packed_down = self.weights.get(f"{i}.down", (mlp.down_proj.weight,), dtype)
        return LayerWeights(
            layer.input_layernorm.weight.to(dtype),
            wqkv,
            bqkv,
            packed_qkv,
            wo,
            packed_o,
            layer.post_attention_layernorm.weight.to(dtype),
            w_gate_up,
            packed_gate_up,
            w_down,
            packed_down,
        )


def _key_store(k: torch.Tensor, key_map: torch.Tensor) -> torch.Tensor:
    """``[rows, kv_heads, width, head_dim]``: each row's keys by position (the engine's exact KV
    cache's layout, and its float32)."""
    padded = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
    rows, width = key_map.shape
    return padded.index_select(0, key_map.reshape(-1)).view(rows, width, *k.shape[1:]).transpose(1, 2)


class ExactHead(torch.autograd.Function):
    """``(logp [N], entropy [N])`` of ``targets`` under ``softmax(hidden @ head.T / T)``: the forward
    tile by tile exactly as the engine computes it (:func:`postrl.models.invariant.logits`, then
    :func:`~postrl.models.invariant.token_logprobs`), keeping no float32 ``[rows, vocab]`` tensor;
    the backward is the lean head's (:func:`~postrl.train.chunked_head.head_gradients`: the gradient
    need not be batch-invariant): from the probabilities, kept in the compute dtype where they fit
    as the lean head keeps them, or from each chunk's logits recomputed. ``head`` (and ``packed``) is
    ``master`` rounded to the compute dtype; the weight's gradient, summed in float32, goes to
    ``master`` in its own dtype (not through a rounded copy)."""

    @staticmethod
    def forward(ctx: Any, hidden, master, head, packed, targets, temperature: float, with_entropy: bool):
        n, vocab = hidden.shape[0], head.shape[0]
        logp, lse, entropy = (hidden.new_empty(n, dtype=torch.float32) for _ in range(3))
        keep = (
            temperature == 1.0
            and not with_entropy
            and head.dtype in (torch.float16, torch.bfloat16)
            and any(ctx.needs_input_grad[:2])
            and n * vocab <= KEPT_PROBS_ELEMENTS
        )
        probs = hidden.new_empty(n, vocab, dtype=head.dtype) if keep else None
        tiles = zip(invariant.row_tiles(hidden), invariant.row_tiles(targets), strict=True)
        for s, (h, tok) in enumerate(tiles):
            rows = slice(s * invariant.TILE_ROWS, min(n, (s + 1) * invariant.TILE_ROWS))
            real = rows.stop - rows.start
            z = invariant.scaled(invariant.head_logits(h, head, packed), temperature)
            log_p = torch.log_softmax(z, dim=-1)
            logp[rows] = log_p.gather(-1, tok[:, None])[:real, 0]
            lse[rows] = (z[:real, 0] - log_p[:real, 0]).float()
            entropy[rows] = -(log_p[:real].exp() * log_p[:real]).sum(-1) if with_entropy else 0.0
            if probs is not None:
                probs[rows] = log_p[:real].exp()
        ctx.save_for_backward(hidden, head, targets, lse, entropy, probs if probs is not None else lse)
        ctx.keeps_probs = probs is not None
        ctx.master_dtype = master.dtype
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp, grad_entropy):
        hidden, head, targets, lse, entropy, probs = ctx.saved_tensors
        grad_h, grad_w = head_gradients(
            HeadSaved(hidden, head, targets, lse, entropy, probs if ctx.keeps_probs else None),
            grad_logp,
            grad_entropy if ctx.with_entropy else None,
            ctx.temperature,
            rows_per_chunk(head.shape[0]),
            (ctx.needs_input_grad[0], ctx.needs_input_grad[1]),
        )
        grad_hidden = None if grad_h is None else grad_h.to(hidden.dtype)
        grad_master = None if grad_w is None else grad_w.to(ctx.master_dtype)
        return grad_hidden, grad_master, None, None, None, None, None
