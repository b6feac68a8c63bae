"""A lean training forward for the Llama / Qwen2 / Mistral family over shared-prompt groups.

The transformers forward of a packed group (``prompt, response_1, ..., response_G`` in one row
with a block mask, :func:`~postrl.train.logprobs.pack_shared_prompts`) computes attention over
the whole packed row: (P + G n)^2 scores per head, of which each response needs n (P + n). Here
the tokens of a micro-batch are one flat ``[T, hidden]`` list (no padding in any projection),
and attention runs per *block*: each prompt attends causally to itself, each response to its
prompt and causally to itself, all blocks batched together. With 8 responses of 64 tokens on a
40-token prompt that is 5x fewer attention scores. The parameters are the model's own (the
optimizer, checkpoints and weight sync see nothing new): the projections are called as modules,
so autocast, peft's LoRA layers and forward hooks apply; the norms are one fused op. The values and gradients equal the transformers
model's up to rounding (tested in float32 and bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from postrl.models.loading import PLAIN_HEAD_MODEL_TYPES


def supports_lean_forward(model: torch.nn.Module) -> bool:  # model: unwrapped (lora.base_of)
    """A plain (unwrapped; not sharded: FSDP2 gathers parameters in the model's own forward)
    Llama-family model whose layers this forward reproduces:
    silu MLP without bias, rotary embeddings fixed by ``inv_freq``, no sliding window, plain
    ``nn.Linear`` projections or plain peft LoRA layers over them (DoRA, several adapters, quantized
    layers and the like take the transformers path)."""
    config = getattr(model, "config", None)
    if (
        isinstance(model, FSDPModule)
        or config is None
        or getattr(config, "model_type", "") not in PLAIN_HEAD_MODEL_TYPES
    ):
        return False
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        if config.model_type == "mistral":
            return False
    rope = getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "llama3", "linear"):
        return False
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not hasattr(decoder, "rotary_emb"):
        return False
    projections = [
        m
        for layer in layers
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj)
        + (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    ]
    plain = all(type(m) is torch.nn.Linear or _plain_lora(m) for m in projections)
    return plain and type(model.get_output_embeddings()) is torch.nn.Linear


def _plain_lora(module: torch.nn.Module) -> bool:
    """A peft LoRA linear layer over a plain ``nn.Linear`` with one adapter and no DoRA."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return False
    return (
        type(module) is LoraLinear
        and type(module.base_layer) is torch.nn.Linear
        and list(module.lora_A) == ["default"]
        and not module.use_dora.get("default", False)
    )


@dataclass
class BlockLayout:
    """A micro-batch as flat tokens and attention blocks.

    ``tokens [T]`` and ``positions [T]``; block ``b`` has queries ``query_index[b]`` (``[Q]``,
    padded with ``T``, a zero row) attending keys ``key_index[b]`` (``[K]``, padded with ``T``)
    where ``allowed[b]`` (``[Q, K]``) is true."""

    tokens: torch.Tensor
    positions: torch.Tensor
    query_index: torch.Tensor  # [B, Q]
    key_index: torch.Tensor  # [B, K]
    allowed: torch.Tensor  # [B, Q, K] bool


def block_layout(groups: list[tuple[list[int], list[list[int]]]], device: torch.device) -> BlockLayout:
    """The layout of ``groups``: (prompt tokens, [response tokens, ...]) each."""
    tokens: list[int] = []
    positions: list[int] = []
    blocks: list[tuple[list[int], list[int]]] = []  # (queries, keys) of each block
    for prompt, responses in groups:
        start, p = len(tokens), len(prompt)
        tokens += prompt
        positions += range(p)
        prompt_index = list(range(start, start + p))
        blocks.append((prompt_index, prompt_index))
        for response in responses:
            first = len(tokens)
            tokens += response
            positions += range(p, p + len(response))
            own = list(range(first, first + len(response)))
            blocks.append((own, prompt_index + own))
    total = len(tokens)
    width_q = max(len(b[0]) for b in blocks)
    width_k = max(len(b[1]) for b in blocks)
    query_index = torch.full((len(blocks), width_q), total, dtype=torch.long)
    key_index = torch.full((len(blocks), width_k), total, dtype=torch.long)
    allowed = torch.zeros(len(blocks), width_q, width_k, dtype=torch.bool)
    for b, (queries, keys) in enumerate(blocks):
        query_index[b, : len(queries)] = torch.tensor(queries)
        key_index[b, : len(keys)] = torch.tensor(keys)
        shared = len(keys) - len(queries)  # the prompt's keys a response sees in full (0 for a prompt)
        causal = torch.ones(len(queries), len(queries), dtype=torch.bool).tril()
        allowed[b, : len(queries), shared : len(keys)] = causal
        allowed[b, : len(queries), :shared] = True
    allowed[:, :, 0] |= ~allowed.any(-1)  # padding queries see one key: no all-masked softmax rows
    return BlockLayout(
        torch.tensor(tokens, device=device),
        torch.tensor(positions, device=device),
        query_index.to(device),
        key_index.to(device),
        allowed.to(device),
    )


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LeanForward:
    """Hidden states of a :class:`BlockLayout` under a Llama-family model's own parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps

    def _dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.model.model.embed_tokens.weight.dtype

    def hidden(self, layout: BlockLayout) -> torch.Tensor:
        """``[T, hidden]`` after the final norm."""
        decoder = self.model.model
        device = layout.tokens.device
        dtype = self._dtype(device)
        rotary: Any = decoder.rotary_emb
        freqs = layout.positions.float()[:, None] * rotary.inv_freq.float().to(device)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        cos, sin = ((emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None])
        bias = torch.zeros(layout.allowed.shape, dtype=torch.promote_types(dtype, torch.float32), device=device)
        bias = bias.masked_fill(~layout.allowed, float("-inf"))[:, None]  # [B, 1, Q, K]
        x = decoder.embed_tokens(layout.tokens).to(dtype)  # the module: its hooks see the forward
        use_checkpoint = self.model.is_activation_checkpointing and torch.is_grad_enabled()
        for layer in decoder.layers:
            if use_checkpoint:
                x = checkpoint(self._layer, layer, x, cos, sin, bias, layout, use_reentrant=False)
            else:
                x = self._layer(layer, x, cos, sin, bias, layout)
        norm = decoder.norm.weight
        return F.rms_norm(x, (x.shape[-1],), norm.to(dtype), self.eps)

    def _layer(self, layer, x, cos, sin, bias, layout: BlockLayout) -> torch.Tensor:
        # the projections are called as modules (autocast casts their weights; a LoRA layer adds its
        # adapters, or not when they are disabled; forward hooks see them)
        attn, mlp = layer.self_attn, layer.mlp
        dtype = x.dtype
        h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight.to(dtype), self.eps)
        d, nh, nkv = self.head_dim, self.heads, self.kv_heads
        q = _rope(attn.q_proj(h).view(-1, nh, d), cos, sin)
        k = _rope(attn.k_proj(h).view(-1, nkv, d), cos, sin)
        v = attn.v_proj(h).view(-1, nkv, d)
        x = x + attn.o_proj(self._attention(q, k, v, bias, layout))
        h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight.to(dtype), self.eps)
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        return x + mlp.down_proj(F.silu(gate) * up)

    def _attention(self, q, k, v, bias, layout: BlockLayout) -> torch.Tensor:
        """``[T, heads * head_dim]``: every block's queries over its keys, scattered back."""
        d, nh, nkv = self.head_dim, self.heads, self.kv_heads
        pad = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])])  # noqa: E731  (row T: padding)
        blocks, width_q = layout.query_index.shape
        qb = pad(q)[layout.query_index].permute(0, 2, 1, 3)  # [B, nh, Q, d]
        kb = pad(k)[layout.key_index].permute(0, 2, 1, 3)  # [B, nkv, K, d]
        vb = pad(v)[layout.key_index].permute(0, 2, 1, 3)
        if nkv != nh:
            kb = kb.repeat_interleave(nh // nkv, dim=1)
            vb = vb.repeat_interleave(nh // nkv, dim=1)
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * d**-0.5 + bias
        exact = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        probs = torch.softmax(scores, dim=-1, dtype=exact).to(q.dtype)
        out = torch.matmul(probs, vb).permute(0, 2, 1, 3).reshape(blocks * width_q, nh * d)
        flat = layout.query_index.reshape(-1)
        real = flat < q.shape[0]
        result = out.new_zeros(q.shape[0], nh * d)
        return result.index_copy(0, flat[real], out[real])


def shared_prompt_groups(
    input_ids: torch.Tensor, spans: list[tuple[int, int]], group_ids: torch.Tensor | None
) -> dict[int, list[int]]:
    """Rows by ``group_ids`` entry (each row its own group without them), in first-seen order; the
    rows of a group must share their prompt (``spans``: each row's (prompt length, response
    length)), which is checked."""
    members: dict[int, list[int]] = {}
    for row in range(input_ids.shape[0]):
        members.setdefault(int(group_ids[row]) if group_ids is not None else row, []).append(row)
    for group, rows in members.items():
        lead, p = rows[0], spans[rows[0]][0]
        for row in rows[1:]:
            if spans[row][0] != p or not torch.equal(input_ids[row, :p], input_ids[lead, :p]):
                raise ValueError(f"rows {lead} and {row} of group {group} do not share their prompt")
    return members


def group_layout(
    input_ids: torch.Tensor, spans: list[tuple[int, int]], group_ids: torch.Tensor | None
) -> tuple[BlockLayout, torch.Tensor]:
    """The :class:`BlockLayout` of rows that are prompt + one contiguous response (``spans``: each
    row's (prompt length, response length)), rows of one ``group_ids`` entry sharing their prompt
    (checked), and the flat index of the hidden state that predicts each response token, in the
    row-major order of the rows' response positions."""
    members = shared_prompt_groups(input_ids, spans, group_ids)
    ids = input_ids.tolist()
    groups, starts = [], {}
    offset = 0
    for rows in members.values():
        lead, p = rows[0], spans[rows[0]][0]
        prompt_start, offset = offset, offset + p
        responses = []
        for row in rows:
            n = spans[row][1]
            responses.append(ids[row][p : p + n])
            starts[row] = (prompt_start + p - 1, offset)
            offset += n
        groups.append((ids[lead][:p], responses))
    predictors: list[int] = []
    for row in range(input_ids.shape[0]):
        last_prompt, first = starts[row]
        predictors += [last_prompt] + list(range(first, first + spans[row][1] - 1))
    layout = block_layout(groups, input_ids.device)
    return layout, torch.tensor(predictors, dtype=torch.long, device=input_ids.device)
