"""Policy losses, KL penalties and loss aggregation: pure tensor functions in registries.

A policy loss maps :class:`LossInputs` (plus its options as keyword arguments, from its
``algorithm.policy_loss`` section) to per-token losses ``[B, T]`` plus per-token clip
indicators; aggregation turns those into one scalar. Aggregation takes the *global* token
count of the mini-batch, so splitting a mini-batch into micro-batches and summing their
losses gives the same loss and gradient as the whole mini-batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from postrl.algorithms.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")
register_policy_loss = POLICY_LOSSES.register
register_loss_aggregation = LOSS_AGGREGATIONS.register


@dataclass(frozen=True)
class LossInputs:
    logprobs: torch.Tensor  # [B, T] current policy, with grad
    old_logprobs: torch.Tensor  # [B, T] pi_old from the rollout
    advantages: torch.Tensor  # [B] (broadcast over tokens) or [B, T]
    mask: torch.Tensor  # [B, T] 1 for trained tokens


@dataclass(frozen=True)
class PolicyLossOutput:
    per_token: torch.Tensor  # [B, T]
    clipped: torch.Tensor  # [B, T] float, 1 where the clipped branch was taken


def _token_advantages(inputs: LossInputs) -> torch.Tensor:
    adv = inputs.advantages
    return adv.unsqueeze(-1).expand_as(inputs.logprobs) if adv.dim() == 1 else adv


@register_policy_loss("ppo_clip")
def ppo_clip_loss(inputs: LossInputs, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2) -> PolicyLossOutput:
    """PPO clipped surrogate, per token: -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A)."""
    adv = _token_advantages(inputs)
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    took_clip = (clipped < unclipped).to(inputs.logprobs.dtype)
    return PolicyLossOutput(per_token=per_token * inputs.mask, clipped=took_clip * inputs.mask)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


@register_loss_aggregation("token_mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, global_tokens: int | torch.Tensor) -> torch.Tensor:
    """Sum over this micro-batch's response tokens divided by the mini-batch's total token count."""
    return (per_token * mask).sum() / global_tokens

