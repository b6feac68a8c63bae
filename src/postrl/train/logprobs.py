"""Recompute per-token logprobs (and entropy) of a batch under a model."""

from __future__ import annotations

import torch

# causal LMs whose logits are exactly lm_head(decoder(x)): for them the vocabulary projection and
# softmax can be restricted to the positions that are trained on
_PLAIN_HEAD_MODELS = ("llama", "qwen2", "mistral")


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    with_entropy: bool = False, target_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logprob of ``input_ids[:, 1:]`` under ``log_softmax(logits / T)``, shape ``[B, T-1]``.

    Uses the same temperature as the rollout so that ratios against pi_old are meaningful. With
    ``target_mask`` (``[B, T-1]``, 1 where a logprob is needed), positions outside it are 0 and,
    for Llama/Qwen2/Mistral, their vocabulary projection is skipped (prompt tokens are often
    half of a GRPO batch, and the projection + softmax over a 49k vocabulary is its costliest part).
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    targets = input_ids[:, 1:]
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    if target_mask is not None and getattr(model.config, "model_type", "") in _PLAIN_HEAD_MODELS:
        hidden = model.get_decoder()(**kwargs).last_hidden_state[:, :-1]
        where = target_mask.bool()
        logits = model.get_output_embeddings()(hidden[where])  # [N, V]
        logp_sel, ent_sel = _logprobs(logits, targets[where], temperature, with_entropy)
        logp = torch.zeros(targets.shape, dtype=logp_sel.dtype, device=logp_sel.device).masked_scatter(where, logp_sel)
        entropy = None
        if ent_sel is not None:
            entropy = torch.zeros(targets.shape, dtype=ent_sel.dtype, device=ent_sel.device).masked_scatter(where, ent_sel)
        return logp, entropy
    logits = model(**kwargs).logits[:, :-1, :]
    logp, entropy = _logprobs(logits, targets, temperature, with_entropy)
    if target_mask is not None:
        logp = logp * target_mask
    return logp, entropy


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
