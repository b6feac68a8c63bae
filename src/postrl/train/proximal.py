"""Which policy the update counts as "old" (``algorithm.old_logprobs``): one class per value.

PPO's ratio compares the policy being trained with an old one. With samples that lag the trainer
(async runs), decoupled PPO splits the old policy in two: the *proximal* policy the ratio and its
clip use, and the *behaviour* policy that generated the samples, whose gap to the proximal one is
corrected by importance weights (pi_prox / pi_behaviour, see :mod:`postrl.algorithms.importance`).

- :class:`BehaviourIsOld` (``rollout``): the rollout's own logprobs are the old policy; no
  importance correction.
- :class:`Recompute` (``recompute``): the trainer's logprobs before the update, one extra forward
  over the batch in the order the first epoch trains on; in a one-epoch update the first
  mini-batch's own training forward (before any optimizer step) is its proximal policy, so that
  mini-batch skips the extra forward.
- :class:`Approximate` (``approximate``): A-3PO's interpolation between the behaviour's and the
  current logprobs by each token's lag and the update's progress, no extra forward.

:meth:`ProximalPolicy.for_micro` answers the proximal logprobs of a micro-batch (masked to its
responses), or None for "no importance correction".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

from postrl.algorithms.importance import interpolated_proximal
from postrl.config.algorithm import ProximalSource
from postrl.types import ExperienceBatch

# (batch, the first epoch's row order, whether to leave the first mini-batch out) -> [B, T-1]
ProximalForward = Callable[[ExperienceBatch, torch.Tensor, bool], torch.Tensor]


class ProximalPolicy:
    source: ClassVar[ProximalSource]

    def prepare(self, batch: ExperienceBatch, first_order: torch.Tensor) -> ExperienceBatch:
        """The batch as the update trains on it (with proximal logprobs where they are computed ahead)."""
        return batch

    def for_micro(self, micro: ExperienceBatch, own: torch.Tensor, progress: float) -> torch.Tensor | None:
        """The proximal logprobs of ``micro`` (``own``: its training forward's, detached), ``progress``
        (the share of the update's mini-batches done) into the update; None: the behaviour policy is
        the old one, with no importance correction."""
        return None


class BehaviourIsOld(ProximalPolicy):
    source = "rollout"


class Recompute(ProximalPolicy):
    source = "recompute"

    def __init__(self, forward: ProximalForward, epochs: int) -> None:
        self.forward = forward
        self.first_is_own = epochs == 1  # one epoch: the first mini-batch's own forward, before any step

    def prepare(self, batch: ExperienceBatch, first_order: torch.Tensor) -> ExperienceBatch:
        return dataclasses.replace(batch, proximal_logprobs=self.forward(batch, first_order, self.first_is_own))

    def for_micro(self, micro: ExperienceBatch, own: torch.Tensor, progress: float) -> torch.Tensor | None:
        if self.first_is_own and progress == 0:
            return own * micro.response_mask
        return micro.proximal_logprobs


class Approximate(ProximalPolicy):
    source = "approximate"

    def prepare(self, batch: ExperienceBatch, first_order: torch.Tensor) -> ExperienceBatch:
        if batch.token_lags is None:
            raise ValueError("old_logprobs=approximate needs the batch's token_lags (ExperienceBatch.with_lags)")
        return batch

    def for_micro(self, micro: ExperienceBatch, own: torch.Tensor, progress: float) -> torch.Tensor | None:
        if progress > 0:  # after a step: interpolated; before any, the current policy is the proximal one
            assert micro.token_lags is not None  # checked in prepare
            own = interpolated_proximal(micro.old_logprobs, own, micro.token_lags, progress)
        return own * micro.response_mask


def proximal_policy(source: ProximalSource, forward: ProximalForward, epochs: int) -> ProximalPolicy:
    """The object for ``algorithm.old_logprobs`` (resolved)."""
    if source == "recompute":
        return Recompute(forward, epochs)
    return Approximate() if source == "approximate" else BehaviourIsOld()
