"""The advantage stage: an estimator from the registry, run on the StepBatch's tensors."""

from __future__ import annotations

from postrl.algorithms import ADVANTAGES, VALUE_TARGETS, AdvantageInputs
from postrl.config.algorithm import AlgorithmConfig
from postrl.types import Prompt, RewardResult, Rollout, StepBatch


def advantage_inputs(step: StepBatch) -> AdvantageInputs:
    """The estimator's view of the step, in the StepBatch's ``[B, T-1]`` layout (estimators skip
    the positions outside the response mask: tokens the model did not generate, such as a
    tool's output in a multi-turn episode, are outside it)."""
    b = step.batch
    return AdvantageInputs(
        step.rewards,
        b.group_ids,
        response_mask=step.model_mask,
        token_rewards=step.kl_penalty,
        values=b.values,
        baseline_rewards=step.baseline,
    )


def compute_advantage(step: StepBatch, algorithm: AlgorithmConfig) -> None:
    """Set the step's advantages (and, for an estimator that needs values, the critic's targets);
    stages that change them act after (``after_advantage``: distillation's term)."""
    entry = algorithm.advantage
    inputs = advantage_inputs(step)
    step.set_advantages(ADVANTAGES.get(entry.type)(inputs, **entry.options()))
    if ADVANTAGES.needs(entry.type).values:
        step.batch.returns = VALUE_TARGETS.get(entry.type)(inputs, **entry.options())


def rollout_advantages(
    rollouts: list[Rollout], rewards: list[RewardResult], algorithm: AlgorithmConfig, pad_id: int
) -> list[float | list[float]]:
    """Each rollout's advantage under ``algorithm.advantage`` (one number, or one per response
    token), a group being the rollouts of one ``prompt_index``: the design's
    ``compute_advantage(rollouts, rewards)``, outside a step (a step computes them on its StepBatch)."""
    if len(rollouts) != len(rewards):
        raise ValueError(f"{len(rollouts)} rollouts but {len(rewards)} rewards")
    firsts = {r.prompt_index: r for r in reversed(rollouts)}
    prompts = [
        Prompt("", list(firsts[i].prompt_ids)) if i in firsts else Prompt("", [])
        for i in range(max(firsts, default=-1) + 1)
    ]
    step = StepBatch.build(prompts, rollouts, rewards, pad_id)
    compute_advantage(step, algorithm)
    return [step.advantage_of(row) for row in range(len(rollouts))]
