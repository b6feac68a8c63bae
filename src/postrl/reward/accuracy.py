"""The ``accuracy`` of a set of scored samples, one rule for training, validation and ``postrl eval``:
the share of samples whose accuracy component (the reward component marked ``accuracy: true``, the
first verifiable one, or an agent run's ``environment``) reaches ``reward.accuracy_threshold``.
A sample that could not be scored counts as a miss. Without an accuracy component there is no
accuracy (a reward is not a pass or a fail)."""

from __future__ import annotations

from typing import Any

from postrl.reward.reasoning_gym import extract_answer as extract_gym_answer
from postrl.reward.verifiers import extract_final_answer
from postrl.types import Prompt, RewardResult, Rollout
from postrl.types.metric_names import task_accuracy


def accuracy(results: list[RewardResult], component: str | None, threshold: float) -> float | None:
    """The share of ``results`` whose ``component`` reaches ``threshold``; None when there is no
    accuracy component or no result carries it (nothing was scored)."""
    if component is None or not any(component in res.components for res in results):
        return None
    return sum(res.components.get(component, float("-inf")) >= threshold for res in results) / len(results)


def is_correct(result: RewardResult, component: str, threshold: float) -> bool:
    """One sample as :func:`accuracy` counts it."""
    return result.components.get(component, float("-inf")) >= threshold


def per_task_accuracy(
    prompts: list[Prompt],
    rollouts: list[Rollout],
    results: list[RewardResult],
    component: str | None,
    threshold: float,
    prefix: str = "",
) -> dict[str, float]:
    """:func:`accuracy` over each task's samples, for rows that name their task (a ``task_type``
    column, as reasoning-gym rows do): ``accuracy/<task>``, or ``<prefix>/<task>/accuracy``."""
    by_task: dict[str, list[RewardResult]] = {}
    for rollout, result in zip(rollouts, results, strict=True):
        task = prompts[rollout.prompt_index].task_type
        if isinstance(task, str):
            by_task.setdefault(task, []).append(result)
    values = {task_accuracy(task, prefix): accuracy(rs, component, threshold) for task, rs in sorted(by_task.items())}
    return {name: value for name, value in values.items() if value is not None}


def stated_answer(response: str, columns: dict[str, Any]) -> str | None:
    """The answer a response gives, as its row's scorer extracts it (a reasoning-gym row's answer
    format), else the last ``\\boxed{}`` or the ``<answer>`` tag: what majority votes count."""
    answer_format = columns.get("rg_answer_format")
    if isinstance(answer_format, str):
        return extract_gym_answer(response, answer_format)
    return extract_final_answer(response)
