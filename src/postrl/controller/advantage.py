"""The advantage stage: an estimator from the registry, run on the StepBatch's tensors."""

from __future__ import annotations

from postrl.algorithms import ADVANTAGES, VALUE_TARGETS, AdvantageInputs
from postrl.config.algorithm import AlgorithmConfig
from postrl.types import StepBatch


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
    """Set the step's advantages (and, for an estimator that needs values, the critic's targets)."""
    entry = algorithm.advantage
    inputs = advantage_inputs(step)
    step.set_advantages(ADVANTAGES.get(entry.type)(inputs, **entry.options()))
    if ADVANTAGES.needs(entry.type).values:
        step.batch.returns = VALUE_TARGETS.get(entry.type)(inputs, **entry.options())
