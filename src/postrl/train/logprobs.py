"""Recompute per-token logprobs (and entropy) of a batch under a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.fsdp import FSDPModule

from postrl.models.loading import PLAIN_HEAD_MODEL_TYPES, hf
from postrl.train.chunked_head import Entropy, chunked_token_logprobs
from postrl.train.exact_forward import ExactForward, exact_layout, supports_exact_forward
from postrl.train.lean_forward import LeanForward, group_layout, shared_prompt_groups, supports_lean_forward
from postrl.train.lora import base_of

ForwardPath = Literal["exact", "lean", "shared_prompts", "selected", "full"]


@dataclass(frozen=True)
class ForwardPlan:
    """Which forward computes a batch's logprobs, with what it prepared for it and why it was chosen.

    - ``exact``: the native engine's batch-invariant operations (:mod:`postrl.train.exact_forward`,
      ``rollout.exact``): logprobs equal to the engine's bit for bit;
    - ``lean``: the Llama family through :mod:`postrl.train.lean_forward` (shared prompts run once,
      the head only at the wanted positions);
    - ``shared_prompts``: the transformers forward over the samples of a group packed behind their
      one prompt (:func:`pack_shared_prompts`), the head only at the wanted positions;
    - ``selected``: the transformers forward, the head only at the wanted positions;
    - ``full``: the transformers forward with whole logits (no ``target_mask``, or a head with a
      bias or another model type).
    """

    path: ForwardPath
    why: str
    spans: list[tuple[int, int]] | None = None  # lean: each row's (prompt, response) lengths
    packed: PackedPrompts | None = None  # shared_prompts


def plan_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor | None,
    group_ids: torch.Tensor | None,
    lean: bool,
    exact: bool = False,
) -> ForwardPlan:
    """The first of the forwards that applies (see :class:`ForwardPlan`); ``exact`` asks for the
    exact one, and it is an error when it cannot run (a silent fallback would not be exact)."""
    if exact:
        why = supports_exact_forward(base_of(model))
        spans = None if target_mask is None else _prompt_response_spans(attention_mask, target_mask)
        if why is None and spans is None:
            why = "its rows must be prompt + one contiguous response (right-padded)"
        if why is not None:
            raise ValueError(f"train.forward=exact (rollout.exact) cannot run on this batch: {why}")
        return ForwardPlan("exact", "rollout.exact: the engine's batch-invariant operations", spans=spans)
    model_type = getattr(model.config, "model_type", "")
    if target_mask is None:
        return ForwardPlan("full", "every position's logprob is wanted (no target_mask)")
    if model_type not in PLAIN_HEAD_MODEL_TYPES:
        return ForwardPlan("full", f"model type {model_type or '?'} is not one whose head can be applied apart")
    if lean and supports_lean_forward(base_of(model)):
        spans = _prompt_response_spans(attention_mask, target_mask)
        if spans is not None:
            return ForwardPlan("lean", "a Llama-family model and rows of prompt + one response", spans=spans)
    if group_ids is not None:
        packed = pack_shared_prompts(input_ids, attention_mask, target_mask, group_ids)
        if packed is not None:
            return ForwardPlan("shared_prompts", "samples of a group share their prompt", packed=packed)
    return ForwardPlan("selected", "no prompt to share (or rows that are not prompt + response)")


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: Entropy = "off",
    target_mask: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    lean: bool = True,
    fused_head: bool = True,
    plan: ForwardPlan | None = None,
    exact_forward: ExactForward | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logprob of ``input_ids[:, 1:]`` under ``log_softmax(logits / T)``, shape ``[B, T-1]``.

    Uses the same temperature as the rollout so that ratios against pi_old are meaningful. With
    ``target_mask`` (``[B, T-1]``, 1 where a logprob is needed), positions outside it are 0 and,
    for Llama/Qwen2/Mistral, their vocabulary projection is skipped (prompt tokens are often
    half of a GRPO batch, and the projection + softmax over a 49k vocabulary is its costliest part),
    and rows of the same ``group_ids`` entry (samples of one prompt) run their prompt once. The
    forward is chosen by :func:`plan_forward` (or given as ``plan``); ``lean`` allows the lean one,
    and ``fused_head`` lets its half-precision head run as one compiled pass
    (:func:`~postrl.train.chunked_head.fused_softmax_stats`). ``exact_forward``: the model's kept
    :class:`~postrl.train.exact_forward.ExactForward` for the exact path (one is made otherwise).
    """
    plan = plan or plan_forward(model, input_ids, attention_mask, target_mask, group_ids, lean)
    if plan.path == "full":
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
        logp, entropy = _logprobs(logits.logits[:, :-1, :], input_ids[:, 1:], temperature, with_entropy)
        return (logp, entropy) if target_mask is None else (logp * target_mask, entropy)
    assert target_mask is not None  # every other path projects only the wanted positions
    where, targets = target_mask.bool(), input_ids[:, 1:]
    if plan.path in ("exact", "lean"):
        assert plan.spans is not None
        if plan.path == "exact":
            forward = exact_forward or ExactForward(base_of(model))
            logp_sel, ent_sel = _exact_selected(
                forward, input_ids, plan.spans, group_ids, targets[where], temperature, with_entropy
            )
        else:
            logp_sel, ent_sel = _lean_selected(
                model, input_ids, plan.spans, group_ids, targets[where], temperature, with_entropy, fused_head
            )
        return _scatter(logp_sel, where), None if ent_sel is None else _scatter(ent_sel, where)
    if plan.path == "shared_prompts":
        assert plan.packed is not None
        return _shared_prompt_logprobs(model, plan.packed, input_ids, target_mask, temperature, with_entropy)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    rows, cols = where.nonzero(as_tuple=True)  # row-major, as masked_scatter fills
    return _selected_logprobs(model, kwargs, rows, cols, targets, where, temperature, with_entropy)


def _exact_selected(
    forward: ExactForward,
    input_ids: torch.Tensor,
    spans: list[tuple[int, int]],
    group_ids: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: Entropy,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The wanted positions' logprobs (and entropy) through the engine's exact operations."""
    layout = exact_layout(input_ids, spans, group_ids)
    logp, entropy = forward.token_logprobs(layout, targets, temperature, with_entropy != "off")
    if with_entropy == "value" and entropy is not None:
        entropy = entropy.detach()
    return logp, entropy


def _lean_selected(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    spans: list[tuple[int, int]],
    group_ids: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: Entropy,
    fused_head: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The wanted positions' logprobs (and entropy) through the lean forward and the chunked head."""
    inner = base_of(model)
    layout, predictors = group_layout(input_ids, spans, group_ids)
    hidden = LeanForward(inner).hidden(layout)[predictors]
    return chunked_token_logprobs(
        hidden, output_head(inner).weight, targets, temperature, with_entropy, fused=fused_head
    )


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's vocabulary projection."""
    head = hf(model).get_output_embeddings()
    assert isinstance(head, torch.nn.Linear)
    return head


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: Entropy):
    """From whole logits, by the formulas of :class:`~postrl.train.chunked_head.ChunkedTokenLogprobs`'s
    forward, so that both paths round alike."""
    out = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if temperature != 1.0:
        logits = logits.to(out) / temperature
    log_p = torch.log_softmax(logits, dim=-1, dtype=out)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy != "off":  # "grad": the entropy takes part in the loss (an entropy bonus)
        with torch.set_grad_enabled(with_entropy == "grad" and torch.is_grad_enabled()):
            entropy = -(torch.exp(log_p) * log_p).sum(-1)
    return logp, entropy


@dataclass
class PackedPrompts:
    """Rows that share a prompt packed into one sequence: ``prompt, response_1, ..., response_k``.

    Each response attends to the prompt and causally to itself only (a block mask) and keeps its
    own positions, so every logprob equals the unpacked one while the prompt is run once per
    group instead of once per sample (GRPO's G samples share their prompt).
    """

    input_ids: torch.Tensor  # [S, L]
    position_ids: torch.Tensor  # [S, L]
    mask: torch.Tensor  # [S, 1, L, L] additive float mask
    target_seq: torch.Tensor  # [N] packed row of each target, in row-major order of target_mask
    target_pos: torch.Tensor  # [N] position in that row whose hidden state predicts the target


def _prompt_response_spans(attention_mask: torch.Tensor, target_mask: torch.Tensor) -> list[tuple[int, int]] | None:
    """Each row's (prompt length, response length) when every row is prompt + one contiguous
    response, right-padded; None otherwise."""
    mask = target_mask.bool()
    counts = mask.sum(1).tolist()
    firsts = mask.float().argmax(1).tolist()
    lengths = attention_mask.sum(1).tolist()
    spans = []
    for b in range(mask.shape[0]):
        n, first = int(counts[b]), int(firsts[b])
        if n == 0 or not bool(mask[b, first : first + n].all()) or first + 1 + n > lengths[b]:
            return None
        if int(attention_mask[b, : first + 1 + n].sum()) != first + 1 + n:
            return None  # left padding or holes: not this layout
        spans.append((first + 1, n))
    return spans


def pack_shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor, group_ids: torch.Tensor
) -> PackedPrompts | None:
    """Pack the rows of each group (``group_ids``: the samples of one prompt) into one sequence; None
    when no group has two rows or the layout is not prompt + contiguous response (the caller then
    runs the rows as they are). Rows of a group must share their prompt, which is checked."""
    rows = input_ids.shape[0]
    layout = _prompt_response_spans(attention_mask, target_mask)
    if layout is None:
        return None
    spans = layout
    groups = shared_prompt_groups(input_ids, spans, group_ids)
    if len(groups) == rows:
        return None  # no prompt is shared
    seqs, positions, segments, target_seq, target_pos = [], [], [], [], []
    where: dict[int, tuple[int, int]] = {}  # row -> (packed row, start of its response)
    for s, members in enumerate(groups.values()):
        p = spans[members[0]][0]
        tokens, pos, seg = input_ids[members[0], :p].tolist(), list(range(p)), [-1] * p
        for k, b in enumerate(members):
            n = spans[b][1]
            where[b] = (s, len(tokens))
            tokens += input_ids[b, p : p + n].tolist()
            pos += list(range(p, p + n))
            seg += [k] * n
        seqs.append(tokens)
        positions.append(pos)
        segments.append(seg)
    for b in range(rows):
        s, start = where[b]
        p, n = spans[b]
        target_seq += [s] * n
        target_pos += [p - 1] + list(range(start, start + n - 1))
    width = max(len(t) for t in seqs)
    ids = torch.zeros(len(seqs), width, dtype=input_ids.dtype)
    pos_t = torch.zeros(len(seqs), width, dtype=torch.long)
    seg_t = torch.full((len(seqs), width), -2, dtype=torch.long)  # -2: padding
    for s, (t, q, g) in enumerate(zip(seqs, positions, segments)):
        ids[s, : len(t)] = torch.tensor(t)
        pos_t[s, : len(q)] = torch.tensor(q)
        seg_t[s, : len(g)] = torch.tensor(g)
    device = input_ids.device
    return PackedPrompts(
        ids.to(device),
        pos_t.to(device),
        _block_mask(seg_t)[:, None].to(device),
        torch.tensor(target_seq, device=device),
        torch.tensor(target_pos, device=device),
    )


def _block_mask(segments: torch.Tensor) -> torch.Tensor:
    """Additive ``[S, L, L]`` mask: causal, and a response (segment k >= 0) sees the prompt (-1) and
    itself only; padding (-2) is seen by nothing."""
    width = segments.shape[1]
    q_seg, k_seg = segments[:, :, None], segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & ((k_seg == -1) | (k_seg == q_seg)) & (k_seg != -2)
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: no all-masked rows
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _shared_prompt_logprobs(model, packed: PackedPrompts, input_ids, target_mask, temperature, with_entropy):
    kwargs = dict(
        input_ids=packed.input_ids, attention_mask=packed.mask, position_ids=packed.position_ids, use_cache=False
    )
    targets, where = input_ids[:, 1:], target_mask.bool()  # target_seq/target_pos: row-major order of target_mask
    return _selected_logprobs(
        model, kwargs, packed.target_seq, packed.target_pos, targets, where, temperature, with_entropy
    )


def _selected_logprobs(model, kwargs: dict, rows, cols, targets, where, temperature, with_entropy):
    """Logprobs (and entropy) of ``targets[where]`` from the hidden states at ``(rows[i], cols[i])``,
    projecting only those, scattered back to ``[B, T-1]``.

    The projection and softmax run in chunks of rows (:mod:`postrl.train.chunked_head`). A model
    sharded with FSDP2 must be called through its own forward (that is where its root parameters
    are gathered), so there the logits are asked for by ``logits_to_keep`` (the positions any row
    needs) instead."""
    head = output_head(model)
    if isinstance(model, FSDPModule) or head.bias is not None:
        keep = torch.unique(cols)
        logits = model(**kwargs, logits_to_keep=keep).logits  # [S, len(keep), V]
        logp_sel, ent_sel = _logprobs(
            logits[rows, torch.searchsorted(keep, cols)], targets[where], temperature, with_entropy
        )
    else:
        hidden = model.get_decoder()(**kwargs).last_hidden_state[rows, cols]
        logp_sel, ent_sel = chunked_token_logprobs(hidden, head.weight, targets[where], temperature, with_entropy)
    return _scatter(logp_sel, where), None if ent_sel is None else _scatter(ent_sel, where)


def _scatter(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``values`` (row-major over ``where``) back to ``where``'s shape, 0 elsewhere."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values)
