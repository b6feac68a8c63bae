"""A lean training forward for the Llama / Qwen2 / Mistral family over shared-prompt groups.

The transformers forward of a packed group (``prompt, response_1, ..., response_G`` in one row
with a block mask, :func:`~postrl.train.logprobs.pack_shared_prompts`) computes attention over
the whole packed row: (P + G n)^2 scores per head, of which each response needs n (P + n). Here
the tokens of a micro-batch are one flat ``[T, hidden]`` list (no padding in any projection),
and attention runs per *block*: each prompt attends causally to itself, each response to its
prompt and causally to itself, all blocks batched together. With 8 responses of 64 tokens on a
40-token prompt that is 5x fewer attention scores. The parameters are the model's own (the
optimizer, checkpoints and weight sync see nothing new), read under autocast; peft's LoRA layers
add their adapters (those sharing an input, q|k|v and gate|up, in stacked products); the norms,
the gated activation and the attention softmax are autograd functions that keep only half-precision
tensors for the backward. The values and gradients equal the transformers model's up to rounding
(tested in float32 and bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from postrl.models.lean_ops import RMSNorm, SiluMul
from postrl.models.loading import PLAIN_HEAD_MODEL_TYPES, hf


def supports_lean_forward(model: torch.nn.Module) -> bool:  # model: unwrapped (lora.base_of)
    """A plain (unwrapped; not sharded: FSDP2 gathers parameters in the model's own forward)
    Llama-family model whose layers this forward reproduces:
    silu MLP without bias, rotary embeddings fixed by ``inv_freq``, no sliding window, plain
    ``nn.Linear`` projections or plain peft LoRA layers over them (DoRA, several adapters, quantized
    layers and the like take the transformers path)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", "") not in PLAIN_HEAD_MODEL_TYPES:
        return False
    if any(isinstance(m, FSDPModule) for m in model.modules()):  # sharded, itself or inside a LoRA wrapper
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
    return plain and type(hf(model).get_output_embeddings()) is torch.nn.Linear


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
    where ``allowed[b]`` (``[Q, K]``) is true; token ``t``'s query is row ``query_slot[t]`` of the
    flattened ``[B * Q]`` queries."""

    tokens: torch.Tensor
    positions: torch.Tensor
    query_index: torch.Tensor  # [B, Q]
    key_index: torch.Tensor  # [B, K]
    allowed: torch.Tensor  # [B, Q, K] bool
    query_slot: torch.Tensor  # [T]


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
    query_slot = torch.empty(total, dtype=torch.long)
    for b, (queries, keys) in enumerate(blocks):
        query_index[b, : len(queries)] = torch.tensor(queries)
        query_slot[queries] = torch.arange(b * width_q, b * width_q + len(queries))
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
        query_slot.to(device),
    )


def _project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; for a plain peft LoRA layer with its adapter on, ``base(x) + B(s A(x))``: the
    same sum, with the scale applied to the rank-r product and ``x`` left in its dtype (peft's
    forward casts it to the adapter's float32, and autocast casts it back, in every layer). Its
    parts are still called as modules (autocast, hooks)."""
    lora: Any = module  # a peft LoraLayer (supports_lean_forward let only plain ones through)
    if not _active_lora(module):
        return module(x)
    down = lora.lora_A["default"](lora.lora_dropout["default"](x))
    return lora.base_layer(x) + lora.lora_B["default"](down * lora.scaling["default"])


def _active_lora(module: torch.nn.Module) -> bool:
    lora: Any = module
    return type(module) is not torch.nn.Linear and not lora.disable_adapters and not lora.merged


def _project_together(modules: tuple[torch.nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """``[_project(m, x) for m in modules]`` for projections that read the same ``x``. When they
    are all plain LoRA layers with active adapters and no dropout, as three products instead of
    three per projection: the frozen base weights stacked, the ``A``s stacked, and the ``B``s (scaled)
    as one block-diagonal matrix. Profiled on SmolLM2's q|k|v at 1104 tokens (bf16): 10.5-10.9 ms
    forward+backward against 12.5-13.9 ms layer by layer; the skinny rank-r products are what
    LoRA's backward spends its time on."""
    loras: list[Any] = list(modules)
    if not all(_active_lora(m) and type(m.lora_dropout["default"]) is torch.nn.Identity for m in loras):
        return [_project(m, x) for m in modules]
    bases = [m.base_layer for m in loras]
    biases = [b.bias for b in bases]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        return [_project(m, x) for m in modules]
    down = F.linear(x, torch.cat([m.lora_A["default"].weight for m in loras]))
    up = torch.block_diag(*[m.lora_B["default"].weight * m.scaling["default"] for m in loras])
    out = F.linear(x, torch.cat([b.weight for b in bases]), bias) + F.linear(down, up)
    return list(out.split([b.out_features for b in bases], dim=-1))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype) -> torch.Tensor:
    """RMSNorm of the residual stream, accumulated in float32 and returned in ``out`` (the dtype the
    projections reading it multiply in) (:class:`RMSNorm`)."""
    return RMSNorm.apply(x, weight.to(torch.promote_types(x.dtype, torch.float32)), eps, out)


class HalfSoftmax(torch.autograd.Function):
    """``softmax(scores)`` in float32, returned in ``dtype`` (the attention matmul's), keeping only
    that result for the backward: autograd through ``softmax(dtype=float32).to(bf16)`` keeps the
    float32 probabilities as well as the bf16 ones the matmul saves. In bf16 the backward's
    probabilities are the bf16 ones the forward's matmul used; in float32 it is exact."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        exact = torch.promote_types(scores.dtype, torch.float32)
        probs = torch.softmax(scores, dim=-1, dtype=exact).to(dtype)
        ctx.save_for_backward(probs)
        ctx.scores_dtype = scores.dtype
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (probs,) = ctx.saved_tensors
        exact = torch.promote_types(ctx.scores_dtype, torch.float32)
        p, g = probs.to(exact), grad.to(exact)
        return (p * (g - (g * p).sum(-1, keepdim=True))).to(ctx.scores_dtype), None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LeanForward:
    """Hidden states of a :class:`BlockLayout` under a Llama-family model's own parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg: Any = model.config
        self.model: Any = model  # a transformers Llama-family model: its submodules are reached by name
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.eps = float(cfg.rms_norm_eps)

    def _dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        dtype: torch.dtype = self.model.model.embed_tokens.weight.dtype
        return dtype

    def hidden(self, layout: BlockLayout) -> torch.Tensor:
        """``[T, hidden]`` after the final norm."""
        decoder = self.model.model
        device = layout.tokens.device
        dtype = self._dtype(device)
        rotary: Any = decoder.rotary_emb
        freqs = layout.positions.float()[:, None] * rotary.inv_freq.float().to(device)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        # float32, as the transformers model applies them under autocast: q and k rotate in float32
        cos, sin = (emb.cos() * scale)[:, None], (emb.sin() * scale)[:, None]
        bias = torch.zeros(layout.allowed.shape, dtype=torch.promote_types(dtype, torch.float32), device=device)
        bias = bias.masked_fill(~layout.allowed, float("-inf"))[:, None]  # [B, 1, Q, K]
        # the residual stream stays in the weights' dtype, as in the transformers model under
        # autocast: only the projections' products are bf16, each added to a float32 sum (a bf16
        # residual doubled the gradient's rounding error on SmolLM2: 0.107 of its norm against 0.042)
        x = decoder.embed_tokens(layout.tokens)  # the module: its hooks see the forward
        # the decoder's own flag, set by gradient_checkpointing_enable in every transformers version
        # (PreTrainedModel.is_activation_checkpointing exists only in recent ones)
        use_checkpoint = bool(decoder.gradient_checkpointing) and torch.is_grad_enabled()
        for layer in decoder.layers:
            if use_checkpoint:
                x = checkpoint(self._layer, layer, x, cos, sin, bias, layout, dtype, use_reentrant=False)
            else:
                x = self._layer(layer, x, cos, sin, bias, layout, dtype)
        return _rms_norm(x, decoder.norm.weight, self.eps, dtype)

    def _layer(self, layer, x, cos, sin, bias, layout: BlockLayout, dtype: torch.dtype) -> torch.Tensor:
        # the projections run under autocast (it casts their weights); LoRA layers add their
        # adapters, or not when they are disabled; o_proj and down_proj are called as modules
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms_norm(x, layer.input_layernorm.weight, self.eps, dtype)
        d, nh, nkv = self.head_dim, self.heads, self.kv_heads
        q, k, v = _project_together((attn.q_proj, attn.k_proj, attn.v_proj), h)
        q = _rope(q.view(-1, nh, d), cos, sin)
        k = _rope(k.view(-1, nkv, d), cos, sin)
        x = x + _project(attn.o_proj, self._attention(q, k, v.view(-1, nkv, d), bias, layout, dtype))
        h = _rms_norm(x, layer.post_attention_layernorm.weight, self.eps, dtype)
        gate, up = _project_together((mlp.gate_proj, mlp.up_proj), h)
        return x + _project(mlp.down_proj, SiluMul.apply(gate, up))

    def _attention(self, q, k, v, bias, layout: BlockLayout, dtype: torch.dtype) -> torch.Tensor:
        """``[T, heads * head_dim]``: every block's queries over its keys, gathered back per token.
        Gathers are ``index_select`` (whose backward is ``index_add_``): indexing ``t[index]``
        costs 9x more forward and its backward, ``index_put_`` with accumulation, 17x more on the
        CPU at these shapes."""
        d, nh, nkv = self.head_dim, self.heads, self.kv_heads
        pad = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])])  # noqa: E731  (row T: padding)
        blocks, width_q = layout.query_index.shape
        width_k = layout.key_index.shape[1]
        gather = lambda t, index, width: pad(t).index_select(0, index.reshape(-1)).view(blocks, width, *t.shape[1:])  # noqa: E731
        qb = gather(q, layout.query_index, width_q).permute(0, 2, 1, 3)  # [B, nh, Q, d]
        kb = gather(k, layout.key_index, width_k).permute(0, 2, 1, 3)  # [B, nkv, K, d]
        vb = gather(v, layout.key_index, width_k).permute(0, 2, 1, 3)
        if nkv != nh:
            kb = kb.repeat_interleave(nh // nkv, dim=1)
            vb = vb.repeat_interleave(nh // nkv, dim=1)
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * d**-0.5 + bias
        probs = HalfSoftmax.apply(scores, dtype)
        out = torch.matmul(probs, vb).permute(0, 2, 1, 3).reshape(blocks * width_q, nh * d)
        return out.index_select(0, layout.query_slot)


def shared_prompt_groups(
    input_ids: torch.Tensor, spans: list[tuple[int, int]], group_ids: torch.Tensor | None
) -> dict[int, list[int]]:
    """Rows that share their prompt (``spans``: each row's (prompt length, response length)), in
    first-seen order: the rows of a ``group_ids`` entry (each row alone without them), split where
    their prompts differ (an episode's later samples, or a policy that answers another's text,
    belong to a prompt's group without sharing its first prompt)."""
    members: dict[int, list[int]] = {}
    subgroups: dict[int, list[int]] = {}  # a group's subgroups (their keys in ``members``), in order
    for row in range(input_ids.shape[0]):
        group = int(group_ids[row]) if group_ids is not None else row
        p = spans[row][0]
        key = next(
            (
                k
                for k in subgroups.get(group, [])
                if spans[lead := members[k][0]][0] == p and torch.equal(input_ids[row, :p], input_ids[lead, :p])
            ),
            None,
        )
        if key is None:  # the first row of its group, or one whose prompt differs from the group's so far
            key = len(members)
            subgroups.setdefault(group, []).append(key)
            members[key] = []
        members[key].append(row)
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
