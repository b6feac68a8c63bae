"""Advantage estimators: pure functions of tensors, registered by name.

Every estimator takes an :class:`AdvantageInputs` (plus its own options as keyword arguments, from
its ``algorithm.advantage`` section) and returns one advantage per sample ``[N]`` (broadcast over
the response) or per response token ``[N, T]``.

Conventions, where published implementations differ:
- An unscorable sample (NaN reward) is left out of every baseline and gets advantage 0.
- A group with one scorable sample has no baseline to compare against: its advantage is 0
  (GRPO, RLOO; verl gives such a sample mean 0 / std 1, i.e. its raw reward, which rewards a lone
  sample for the reward's scale).
- A group whose rewards are all equal gives 0 (the std is 0; ``eps`` keeps it finite).
- GRPO's std is the unbiased sample std by default (``std: unbiased``, as torch.std, verl and TRL,
  whose ``nanstd`` applies Bessel's correction), or the population std (``std: biased``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from postrl.algorithms.registry import AdvantageRegistry, Registry

ADVANTAGES: AdvantageRegistry = AdvantageRegistry("advantage estimator")
register_advantage = ADVANTAGES.register
# the critic's regression targets of an estimator that declares needs_values, by the same name
VALUE_TARGETS: Registry = Registry("value target")
register_value_target = VALUE_TARGETS.register


@dataclass(frozen=True)
class AdvantageInputs:
    rewards: torch.Tensor  # [N] float; NaN marks an unscorable sample
    group_ids: torch.Tensor  # [N] long; samples of the same prompt share an id
    response_mask: torch.Tensor | None = None  # [N, T] 1 on response tokens: token-level estimators
    token_rewards: torch.Tensor | None = None  # [N, T] per-token rewards added to the outcome (e.g. -beta * KL)
    values: torch.Tensor | None = None  # [N, T] the critic's value of each response position (GAE)
    baseline_rewards: torch.Tensor | None = None  # [N] the reward of a baseline response (ReMax: the greedy one)


def _group_stats(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(valid, r with 0 for NaN, count per group, sum per group), in float64."""
    rewards = rewards.double()
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    n_groups = int(groups.max().item()) + 1 if groups.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, valid.double())
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, r)
    return valid, r, count, total


@register_advantage("unit")
def unit_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """Advantage 1 for every scored sample (0 for an unscorable one), whatever its reward: with the
    REINFORCE loss, the negative log-likelihood of the trained tokens (SFT, behaviour cloning)."""
    return (~torch.isnan(inputs.rewards)).to(inputs.rewards.dtype)


@register_advantage("grpo", needs_groups=True)
def grpo_advantage(
    inputs: AdvantageInputs, norm_by_std: bool = True, eps: float = 1e-6, std: str = "unbiased"
) -> torch.Tensor:
    """GRPO outcome advantage: (r - mean of the group) / (std of the group + eps)."""
    groups = inputs.group_ids
    valid, r, count, total = _group_stats(inputs.rewards, groups)
    mean = total / count.clamp(min=1)
    centered = torch.where(valid, r - mean[groups], torch.zeros_like(r))
    sq = torch.zeros_like(count).index_add_(0, groups, centered**2)
    dof = (count - 1) if std == "unbiased" else count
    spread = torch.sqrt(sq / dof.clamp(min=1))
    adv = centered / (spread[groups] + eps) if norm_by_std else centered
    adv = torch.where(count[groups] > 1, adv, torch.zeros_like(adv))
    return adv.to(inputs.rewards.dtype)


@register_advantage("dr_grpo", needs_groups=True)
def dr_grpo_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): r - mean of the group, no division by the std (which up-weights
    groups that are nearly solved or nearly failed)."""
    return grpo_advantage(inputs, norm_by_std=False)


@register_advantage("rloo", needs_groups=True)
def rloo_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the *other* scorable samples of its group,
    = k/(k-1) (r_i - mean) for a group of k."""
    groups = inputs.group_ids
    valid, r, count, total = _group_stats(inputs.rewards, groups)
    k = count[groups]
    others = (total[groups] - r) / (k - 1).clamp(min=1)
    adv = torch.where(valid & (k > 1), r - others, torch.zeros_like(r))
    return adv.to(inputs.rewards.dtype)


@register_advantage("remax", needs_baseline=True)
def remax_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """ReMax (Li et al. 2023): r minus the reward of the greedy response to the same prompt."""
    if inputs.baseline_rewards is None:
        raise ValueError("remax needs baseline_rewards: the reward of each prompt's greedy response")
    r, b = inputs.rewards.double(), inputs.baseline_rewards.double()
    ok = ~torch.isnan(r) & ~torch.isnan(b)
    return torch.where(ok, r - b, torch.zeros_like(r)).to(inputs.rewards.dtype)


def _token_rewards(inputs: AdvantageInputs, outcome: torch.Tensor) -> torch.Tensor:
    """Per-token rewards ``[N, T]``: ``token_rewards`` (if any) on every response token plus the
    outcome on the last one."""
    mask = _mask(inputs)
    rewards = torch.zeros_like(mask) if inputs.token_rewards is None else inputs.token_rewards.double() * mask
    last = _last_index(mask)
    has = mask.sum(dim=1) > 0
    rows = torch.arange(mask.shape[0])[has]
    rewards[rows, last[has]] += outcome[has]
    return rewards


def _mask(inputs: AdvantageInputs) -> torch.Tensor:
    if inputs.response_mask is None:
        raise ValueError("a token-level advantage estimator needs the response_mask")
    return inputs.response_mask.double()


def _last_index(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[1], dtype=torch.float64)
    return (mask * (positions + 1)).argmax(dim=1)


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over the masked tokens (masked-out positions pass G through)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in range(rewards.shape[1] - 1, -1, -1):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(on, running, torch.zeros_like(running))
    return returns


def _batch_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch (unbiased std); 0 elsewhere."""
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) / (var.sqrt() + eps) * mask


@register_advantage("reinforce_pp", token_level=True)
def reinforce_pp_advantage(inputs: AdvantageInputs, gamma: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): per-token discounted returns of the outcome plus the per-token rewards
    (the KL penalty), normalised over all response tokens of the batch. Unscorable samples: 0."""
    valid = ~torch.isnan(inputs.rewards.double())
    outcome = torch.where(valid, inputs.rewards.double(), torch.zeros_like(inputs.rewards.double()))
    mask = _mask(inputs) * valid.double().unsqueeze(1)
    returns = _discounted_returns(_token_rewards(inputs, outcome) * mask, mask, gamma)
    return _batch_whiten(returns, mask, eps).to(inputs.rewards.dtype)


@register_advantage("reinforce_pp_baseline", needs_groups=True, token_level=True)
def reinforce_pp_baseline_advantage(inputs: AdvantageInputs, gamma: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline: the outcome minus its group's mean first (as GRPO without the std),
    then REINFORCE++'s returns and batch normalisation."""
    centered = dr_grpo_advantage(inputs).double()
    centered = torch.where(torch.isnan(inputs.rewards.double()), torch.full_like(centered, float("nan")), centered)
    return reinforce_pp_advantage(
        AdvantageInputs(centered, inputs.group_ids, inputs.response_mask, inputs.token_rewards), gamma=gamma, eps=eps
    ).to(inputs.rewards.dtype)


def _gae(inputs: AdvantageInputs, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, values, mask) in float64; see :func:`gae_advantage`."""
    if inputs.values is None:
        raise ValueError("gae needs values: the critic's value of every response position")
    valid = ~torch.isnan(inputs.rewards.double())
    outcome = torch.where(valid, inputs.rewards.double(), torch.zeros_like(inputs.rewards.double()))
    mask = _mask(inputs) * valid.double().unsqueeze(1)
    rewards = _token_rewards(inputs, outcome) * mask
    values = inputs.values.double() * mask
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0], dtype=torch.float64)
    running = torch.zeros_like(next_value)
    for t in range(rewards.shape[1] - 1, -1, -1):
        on = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(on, delta + gamma * lam * running, running)
        next_value = torch.where(on, values[:, t], next_value)
        adv[:, t] = torch.where(on, running, torch.zeros_like(running))
    return adv, values, mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries of the whole batch, unbiased variance,
    0 elsewhere (verl's ``masked_whiten``, OpenRLHF's advantage normalisation)."""
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


@register_advantage("gae", needs_values=True, token_level=True)
def gae_advantage(inputs: AdvantageInputs, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> torch.Tensor:
    """GAE (Schulman et al. 2016) over the response tokens: delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = delta_t + gamma lambda A_{t+1}, with V after the last token = 0. Positions outside the
    response are skipped (their values never enter the result). Unscorable samples: 0.
    ``whiten``: normalised over the batch's scorable response tokens (:func:`masked_whiten`), as
    verl and OpenRLHF do; the critic's targets (:func:`gae_returns`) use the raw advantages."""
    adv, _, mask = _gae(inputs, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv.to(inputs.rewards.dtype)


@register_value_target("gae")
def gae_returns(inputs: AdvantageInputs, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> torch.Tensor:
    """The critic's targets: the raw GAE advantage plus the value, per response token (``whiten``
    applies to the policy's advantages only, as in verl)."""
    adv, values, _ = _gae(inputs, gamma, lam)
    return (adv.to(inputs.rewards.dtype) + values.to(inputs.rewards.dtype)) * _mask(inputs).to(inputs.rewards.dtype)
