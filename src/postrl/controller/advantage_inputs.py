"""From a step's rollouts and rewards to an estimator's tensors, and back to one advantage (or one
per response token) per sample."""

from __future__ import annotations

import math

import torch

from postrl.algorithms import AdvantageInputs
from postrl.types import RewardResult, Rollout


def advantage_inputs(
    rollouts: list[Rollout],
    rewards: list[RewardResult],
    baseline: list[float] | None = None,
    values: list[list[float]] | None = None,
    token_rewards: list[list[float]] | None = None,
) -> AdvantageInputs:
    """Rewards (NaN: unscorable), group ids, the ``[N, T]`` response mask and, for ReMax, each
    sample's baseline reward (its prompt's), for GAE the critic's ``[N, T]`` values, and per-token
    rewards (the KL penalty)."""
    reward = torch.tensor([math.nan if r.reward is None else r.reward for r in rewards], dtype=torch.float32)
    groups = torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long)
    width = max((len(r.response_ids) for r in rollouts), default=0)
    mask = torch.zeros(len(rollouts), width, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        mask[i, : len(r.response_ids)] = 1.0
    base = None if baseline is None else torch.tensor([baseline[r.prompt_index] for r in rollouts], dtype=torch.float32)
    return AdvantageInputs(
        reward,
        groups,
        response_mask=mask,
        baseline_rewards=base,
        values=_padded(values, mask),
        token_rewards=_padded(token_rewards, mask),
    )


def _padded(rows: list[list[float]] | None, like: torch.Tensor) -> torch.Tensor | None:
    if rows is None:
        return None
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=out.dtype)
    return out


def per_sample(advantages: torch.Tensor, rollouts: list[Rollout]) -> list[float | list[float]]:
    """``[N]`` as one float per sample; ``[N, T]`` as each sample's response-length list."""
    if advantages.dim() == 1:
        return advantages.tolist()
    return [row[: len(r.response_ids)] for row, r in zip(advantages.tolist(), rollouts)]
