"""Importance-sampling corrections between the behaviour policy and the proximal policy.

Decoupled PPO (Hilton et al. 2022; AReaL) keeps two "old" policies apart: the *behaviour* policy
is the engine that sampled the tokens (its logprobs come with the rollout, possibly from older
weights, another dtype, another kernel), the *proximal* policy is the trainer's own policy before
the update (its logprobs recomputed by the trainer). The policy loss clips the ratio
``pi / pi_prox``; the gap ``pi_prox / pi_behav`` is corrected by a weight on each token's loss:

    loss_t = w_t * clipped_surrogate(pi_t / pi_prox_t, A_t)

A correction maps ``(proximal, behaviour, mask)`` to :class:`ImportanceWeights` (detached: the
weight carries no gradient). Registered as the other algorithm entries are, so a variant (e.g.
IcePop's two-sided mask) is one decorated function in a plugin module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from postrl.algorithms.losses import LOG_RATIO_CLAMP
from postrl.algorithms.registry import Registry

IMPORTANCE_CORRECTIONS: Registry = Registry("importance correction")
register_importance_correction = IMPORTANCE_CORRECTIONS.register
Level = Literal["token", "sequence"]


@dataclass(frozen=True)
class ImportanceWeights:
    """``weights``: the factor on each token's loss, ``[B, T]``, 0 outside the mask. ``rejected``:
    the tokens whose raw ratio was outside the bounds (truncated by TIS, masked by MIS)."""

    weights: torch.Tensor
    rejected: torch.Tensor


def behaviour_ratio(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, level: Level) -> torch.Tensor:
    """``pi_prox / pi_behav`` per token, or per sequence (the product over its trained tokens,
    spread over them), ``[B, T]``; the log-ratio is clamped to +-20 before ``exp``."""
    log_ratio = (proximal.detach() - behaviour) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(mask)
    elif level != "token":
        raise ValueError(f"importance correction level must be 'token' or 'sequence', got {level!r}")
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _bounded_ratio(
    proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, level: Level, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ratio (:func:`behaviour_ratio`) and the trained tokens where it leaves ``[low, high]``."""
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"importance bounds must satisfy 0 <= low <= 1 <= high, got low={low}, high={high}")
    ratio = behaviour_ratio(proximal, behaviour, mask, level)
    return ratio, ((ratio < low) | (ratio > high)) & mask.bool()


@register_importance_correction("none")
def no_correction(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> ImportanceWeights:
    """Weight 1 on every token: the behaviour policy is taken to be the proximal one."""
    return ImportanceWeights(weights=mask.clone(), rejected=torch.zeros_like(mask, dtype=torch.bool))


@register_importance_correction("tis")
def truncated_importance_sampling(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    level: Level = "token",
    low: float = 0.0,
    high: float = 2.0,
) -> ImportanceWeights:
    """TIS: ``w = clip(pi_prox / pi_behav, low, high)``; ``low=0, high=C`` is Yao et al.'s
    ``min(ratio, C)``, ``low=1-eps, high=1+eps`` the symmetric clip."""
    ratio, rejected = _bounded_ratio(proximal, behaviour, mask, level, low, high)
    return ImportanceWeights(weights=torch.clamp(ratio, low, high) * mask, rejected=rejected)


@register_importance_correction("mis")
def masked_importance_sampling(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    level: Level = "token",
    low: float = 0.5,
    high: float = 2.0,
) -> ImportanceWeights:
    """MIS: ``w = ratio`` where ``low <= ratio <= high`` and 0 elsewhere (the token, or with
    ``level=sequence`` the whole sequence, leaves the gradient)."""
    ratio, rejected = _bounded_ratio(proximal, behaviour, mask, level, low, high)
    return ImportanceWeights(weights=torch.where(rejected, 0.0, ratio) * mask, rejected=rejected)


def interpolated_proximal(
    behaviour: torch.Tensor, current: torch.Tensor, lags: torch.Tensor, progress: float
) -> torch.Tensor:
    """A-3PO's proximal policy without a forward pass (Li et al. 2025; AReaL's ``prox_approx``):
    the log-linear interpolation ``log pi_prox = log pi_behav + alpha (log pi - log pi_behav)``,
    per token, at the version the proximal policy sits at between the behaviour's and the
    current policy's.

    ``lags``: versions between each token's weights and the proximal policy (the trainer's weights
    when the update began), ``[B, T]``; ``progress``: the share of the update's optimizer steps
    already taken, in ``[0, 1)``, so the current policy is at version ``prox + progress`` and
    ``alpha = lag / (lag + progress)``. Before the first step (``progress = 0``) alpha is 1 and
    the result is the current logprobs exactly (``torch.lerp`` is exact at its ends); a token of
    the proximal version itself (lag 0) later in the update keeps its behaviour logprob.
    Detached: the proximal policy carries no gradient."""
    if not 0.0 <= progress < 1.0:
        raise ValueError(f"progress must be in [0, 1), got {progress}")
    lag = lags.clamp(min=0).to(current.dtype)
    span = lag + progress
    alpha = torch.where(span > 0, lag / span.clamp(min=torch.finfo(current.dtype).tiny), torch.ones_like(span))
    return torch.lerp(behaviour.to(current.dtype), current.detach(), alpha)
