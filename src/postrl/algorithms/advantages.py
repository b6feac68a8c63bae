"""Advantage estimators: pure functions of tensors, registered by name.

Every estimator takes an :class:`AdvantageInputs` (plus its own options as keyword arguments, from
its ``algorithm.advantage`` section) and returns one advantage per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from postrl.algorithms.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
register_advantage = ADVANTAGES.register


@dataclass(frozen=True)
class AdvantageInputs:
    rewards: torch.Tensor  # [N] float; NaN marks an unscorable sample
    group_ids: torch.Tensor  # [N] long; samples of the same prompt share an id


@register_advantage("grpo", needs_groups=True)
def grpo_advantage(inputs: AdvantageInputs, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage: (r - mean_group) / (std_group + eps).

    Unscorable samples (NaN reward) are left out of their group's mean and std and get advantage 0.
    A group whose scorable rewards are all equal, or with a single scorable sample, gives 0.
    The std is the unbiased sample std, as in the GRPO paper's reference implementation.
    """
    rewards, groups = inputs.rewards.double(), inputs.group_ids
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    n_groups = int(groups.max().item()) + 1 if groups.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, valid.double())
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, r)
    mean = total / count.clamp(min=1)
    centered = torch.where(valid, r - mean[groups], torch.zeros_like(r))
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, centered**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    adv = centered / (std[groups] + eps) if norm_by_std else centered
    adv = torch.where(count[groups] > 1, adv, torch.zeros_like(adv))
    return adv.to(inputs.rewards.dtype)
