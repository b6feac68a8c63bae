"""The ``accuracy`` of a set of scored samples, one rule for training, validation and ``postrl eval``:
the share of samples whose accuracy component (the reward component marked ``accuracy: true``, the
first verifiable one, or an agent run's ``environment``) reaches ``reward.accuracy_threshold``.
A sample that could not be scored counts as a miss. Without an accuracy component there is no
accuracy (a reward is not a pass or a fail)."""

from __future__ import annotations

from postrl.types import RewardResult


def accuracy(results: list[RewardResult], component: str | None, threshold: float) -> float | None:
    """The share of ``results`` whose ``component`` reaches ``threshold``; None when there is no
    accuracy component or no result carries it (nothing was scored)."""
    if component is None or not any(component in res.components for res in results):
        return None
    return sum(res.components.get(component, float("-inf")) >= threshold for res in results) / len(results)
