"""The native engine's logprob of every token of a given sequence (what ``echo`` with ``logprobs``
returns, and what a distillation teacher serves): one prefill of the sequence through the engine's
own model and kernels, into a cache of its own, with the logits of every position."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from postrl.models import invariant
from postrl.rollout.native.kv_cache import KVCache
from postrl.rollout.native.model import NativeCausalLM


def sequence_logprobs(model: NativeCausalLM, ids: list[int]) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t = 1 .. len(ids) - 1, untempered, in float32 (the first
    token has no context: it gets none)."""
    if len(ids) < 2:
        return []
    cfg, device = model.cfg, model.device
    cache = KVCache(cfg.layers, 1, cfg.kv_heads, len(ids), cfg.head_dim, model.cache_dtype, device)
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    positions = torch.arange(len(ids), device=device)
    slots = torch.zeros(len(ids), dtype=torch.long, device=device)
    attend = _exact_attend(cache, slots, positions) if model.exact else _causal_attend(cache, model, len(ids))
    with torch.no_grad():
        logits = model.forward(tokens, positions, cache, slots, attend)
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return logp.gather(-1, tokens[1:].unsqueeze(-1)).squeeze(-1).cpu().tolist()


def _causal_attend(cache: KVCache, model: NativeCausalLM, n: int) -> Callable[..., torch.Tensor]:
    cfg = model.cfg

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = cache.k[layer][:1, :, :n], cache.v[layer][:1, :, :n]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0).transpose(1, 2).to(keys.dtype),
            keys,
            values,
            is_causal=True,
            enable_gqa=cfg.kv_heads != cfg.heads,
        )
        return out.transpose(1, 2).reshape(n, cfg.heads * cfg.head_dim).to(q.dtype)

    return attend


def _exact_attend(cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> Callable[..., torch.Tensor]:
    items = invariant.query_items(slots, positions)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return invariant.attention(q, cache.k[layer], cache.v[layer], items)

    return attend
