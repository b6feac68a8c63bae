"""Token sampling for all running sequences at once: temperature, top-k, top-p, each row with the
uniforms of its own random stream (:mod:`postrl.rollout.streams`)."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf. ``logits`` is ``[B, V]`` float32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with the row's two uniforms ``u`` ``[B, 2]``; returns (token ids
    [B], logprob [B]).

    The logprob is that of the sampled token under the temperature-scaled, *unfiltered*
    distribution: the same quantity the Train Worker recomputes (log_softmax(logits / T)).
    ``temperature == 0`` is greedy decoding (logprobs then at T = 1).
    """
    if temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if top_k > 0 or top_p < 1.0:
        probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)
    else:
        probs = logprobs.exp()
    tokens = sample_categorical(probs, u)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample_categorical(probs: torch.Tensor, u: torch.Tensor, block: int = 512) -> torch.Tensor:
    """Exact inverse-CDF sampling from ``probs`` ``[B, V]`` in two levels: first a block of
    ``block`` tokens by its mass, then a token inside it. Two uniforms per row (``u`` ``[B, 2]``),
    instead of the V exponentials ``torch.multinomial`` draws (which dominate a CPU decode step at
    V = 49k).
    """
    rows, vocab = probs.shape
    pad = (-vocab) % block
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(rows, -1, block)
    block_cdf = blocks.sum(-1).cumsum(-1)
    u = u.to(device=probs.device, dtype=probs.dtype)
    target = u[:, :1] * block_cdf[:, -1:]
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    # sample inside the block, a block whose mass is zero cannot be chosen
    inner = blocks.gather(1, b.unsqueeze(-1).expand(rows, 1, block)).squeeze(1).cumsum(-1)
    t = torch.searchsorted(inner, u[:, 1:] * inner[:, -1:], right=True).clamp_(max=block - 1)
    return (b * block + t).squeeze(-1).clamp_(max=vocab - 1)


def top_logprobs(logits: torch.Tensor, temperature: float, k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely tokens of each row with their logprobs, under the same distribution
    as :func:`sample_tokens` reports (temperature-scaled; T = 1 for greedy)."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    values, ids = torch.log_softmax(scaled, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return [list(zip(row_ids, row_vals)) for row_ids, row_vals in zip(ids.tolist(), values.tolist())]
