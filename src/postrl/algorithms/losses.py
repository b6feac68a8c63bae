"""Policy losses, KL estimators and loss aggregation: pure tensor functions in registries.

A policy loss maps :class:`LossInputs` (plus its options as keyword arguments, from its
``algorithm.policy_loss`` section) to per-token losses ``[B, T]`` and the metrics it reports, by
name, each per token with its reduction (:class:`TokenMetric`: e.g. which branch was taken, for
the clip fractions); the trainer reduces them over the whole update. The log-ratio is clamped to +-20 before ``exp``.
Aggregation turns per-token losses into one scalar with *global* normalisers
(:class:`LossNormalizer`: the mini-batch's tokens and sequences over every micro-batch and rank),
so any micro-batch split (and any number of ranks) gives the same loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from postrl.algorithms.registry import Registry
from postrl.types.metric_names import (
    ACTOR_APPROX_KL,
    ACTOR_CLIP_FRACTION,
    ACTOR_CLIP_HIGH,
    ACTOR_CLIP_LOW,
    ACTOR_DUAL_CLIP,
)

POLICY_LOSSES: Registry = Registry("policy loss")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")
KL_ESTIMATORS: Registry = Registry("KL estimator")
register_policy_loss = POLICY_LOSSES.register
register_loss_aggregation = LOSS_AGGREGATIONS.register
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossInputs:
    logprobs: torch.Tensor  # [B, T] current policy, with grad
    old_logprobs: torch.Tensor  # [B, T] pi_old from the rollout
    advantages: torch.Tensor  # [B] (broadcast over tokens) or [B, T]
    mask: torch.Tensor  # [B, T] 1 for trained tokens


Reduction = Literal["token_mean", "sum", "max"]


@dataclass(frozen=True)
class TokenMetric:
    """A loss's metric per token (``[B, T]``, 0 outside the mask) and its reduction over the update:
    ``token_mean`` (summed, divided by the trained tokens), ``sum`` or ``max``."""

    per_token: torch.Tensor
    reduce: Reduction = "token_mean"

    def reduced(self) -> torch.Tensor:
        """This micro-batch's part: the sum, or the maximum."""
        return self.per_token.max() if self.reduce == "max" else self.per_token.sum()


@dataclass(frozen=True)
class PolicyLossOutput:
    per_token: torch.Tensor  # [B, T]
    metrics: dict[str, TokenMetric] = field(default_factory=dict)  # by metric name, e.g. actor/clip_fraction


def clip_metrics(
    at_low: torch.Tensor, at_high: torch.Tensor, inputs: LossInputs, dual: torch.Tensor | None = None
) -> dict[str, TokenMetric]:
    """The clip fractions (either bound, each bound, the dual clip) and k3 KL(pi_old || pi)."""
    f, mask = inputs.logprobs.dtype, inputs.mask
    metrics = {
        ACTOR_CLIP_FRACTION: TokenMetric((at_low | at_high).to(f) * mask),
        ACTOR_CLIP_LOW: TokenMetric(at_low.to(f) * mask),
        ACTOR_CLIP_HIGH: TokenMetric(at_high.to(f) * mask),
        ACTOR_APPROX_KL: TokenMetric(_approx_kl(inputs)),
    }
    if dual is not None:
        metrics[ACTOR_DUAL_CLIP] = TokenMetric(dual.to(f) * mask)
    return metrics


def _token_advantages(inputs: LossInputs) -> torch.Tensor:
    adv = inputs.advantages
    return adv.unsqueeze(-1).expand_as(inputs.logprobs) if adv.dim() == 1 else adv


def _log_ratio(inputs: LossInputs) -> torch.Tensor:
    return torch.clamp(inputs.logprobs - inputs.old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _approx_kl(inputs: LossInputs) -> torch.Tensor:
    with torch.no_grad():
        return kl_k3(inputs.old_logprobs, inputs.logprobs.detach()) * inputs.mask


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float):
    """max(-A r, -A clip(r, 1-low, 1+high)) and where each bound was the one taken."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    took = clipped > unclipped
    with torch.no_grad():
        at_low = took & (ratio < 1.0 - low)
        at_high = took & (ratio > 1.0 + high)
    return loss, at_low, at_high


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    inputs: LossInputs, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip_c: float | None = None
) -> PolicyLossOutput:
    """PPO's clipped surrogate, per token, with asymmetric bounds (DAPO's clip-higher: a larger
    ``clip_eps_high``) and an optional dual clip (Ye et al. 2020): the loss of a negative-advantage
    token is bounded by ``-c * A``. The dual clip is off by default: it matters only when the policy
    has drifted far from pi_old (many epochs, stale samples), and postrl's default is one on-policy
    epoch, where the ratio stays near 1."""
    adv, mask = _token_advantages(inputs), inputs.mask
    ratio = torch.exp(_log_ratio(inputs))
    loss, at_low, at_high = _clipped_surrogate(ratio, adv, clip_eps_low, clip_eps_high)
    dual = torch.zeros_like(at_low)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        bound = -adv * dual_clip_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return PolicyLossOutput(per_token=loss * mask, metrics=clip_metrics(at_low, at_high, inputs, dual))


@register_policy_loss("gspo")
def gspo_loss(inputs: LossInputs, clip_eps_low: float = 3e-4, clip_eps_high: float = 4e-4) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, exp(mean over its tokens of
    log pi - log pi_old) (length-normalised), clipped as PPO clips; every token carries it (the
    gradient is the sequence ratio's, spread over the tokens)."""
    adv, mask = _token_advantages(inputs), inputs.mask
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    seq = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    seq = torch.clamp(seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio = seq.detach().unsqueeze(-1) + inputs.logprobs - inputs.logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    loss, at_low, at_high = _clipped_surrogate(ratio, adv, clip_eps_low, clip_eps_high)
    return PolicyLossOutput(per_token=loss * mask, metrics=clip_metrics(at_low, at_high, inputs))


@register_policy_loss("cispo")
def cispo_loss(inputs: LossInputs, clip_eps_low: float = 1.0, clip_eps_high: float = 0.28) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): a REINFORCE term weighted by the importance ratio, clipped and
    with its gradient stopped: -sg(clip(r, 1-low, 1+high)) * A * log pi. Unlike PPO no token's
    gradient is dropped; only its weight is bounded. ``clip_eps_low=1`` leaves no lower bound."""
    adv, mask = _token_advantages(inputs), inputs.mask
    with torch.no_grad():
        ratio = torch.exp(_log_ratio(inputs))
        weight = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
        at_low, at_high = ratio < 1.0 - clip_eps_low, ratio > 1.0 + clip_eps_high
    return PolicyLossOutput(
        per_token=-weight * adv * inputs.logprobs * mask, metrics=clip_metrics(at_low, at_high, inputs)
    )


@register_policy_loss("reinforce")
def reinforce_loss(inputs: LossInputs) -> PolicyLossOutput:
    """Plain REINFORCE: -A * log pi per token, no importance ratio and no clipping (on-policy only)."""
    adv, mask = _token_advantages(inputs), inputs.mask
    return PolicyLossOutput(
        per_token=-adv * inputs.logprobs * mask, metrics={ACTOR_APPROX_KL: TokenMetric(_approx_kl(inputs))}
    )


# -- KL estimators: of KL(pi || ref) per token, from logprobs of the sampled tokens ------------------
@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log pi - log ref: unbiased, can be negative per token."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(log pi - log ref)^2 / 2: biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3: exp(ref - logp) - (ref - logp) - 1: unbiased and >= 0."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """|logp - ref| (verl's ``abs``): k1's magnitude, >= 0 but biased (not an estimate of the KL)."""
    return (logprobs - ref_logprobs).abs()


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", clamp: float | None = None
) -> torch.Tensor:
    """A registered estimator, optionally clamped to [-clamp, clamp] (verl's low-variance KL uses 10)."""
    kl = KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
    return kl if clamp is None else torch.clamp(kl, -clamp, clamp)


# -- aggregation -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossNormalizer:
    """Global normalisers of one mini-batch (over every micro-batch, divided by the number of ranks
    when ranks average their gradients): trained tokens, sequences with a trained token, and the
    constant response budget of Dr. GRPO's normaliser."""

    tokens: torch.Tensor | float
    sequences: torch.Tensor | float
    max_tokens: int


@register_loss_aggregation("token_mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Every trained token weighs the same: sum / the mini-batch's trained tokens (verl: token-mean)."""
    return (per_token * mask).sum() / norm.tokens


@register_loss_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Every sequence weighs the same: the mean over sequences of each one's token mean (GRPO paper;
    verl: seq-mean-token-mean)."""
    per_seq = (per_token * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return per_seq.sum() / norm.sequences


@register_loss_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """The mean over sequences of each one's token sum (longer sequences weigh more)."""
    return (per_token * mask).sum() / norm.sequences


@register_loss_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Dr. GRPO: token sums over sequences x a constant (the response budget, rollout.max_tokens),
    so neither the sequence's length nor the batch's token count rescales a token's gradient."""
    return (per_token * mask).sum() / (norm.sequences * norm.max_tokens)
