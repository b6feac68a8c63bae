"""A stage some algorithms add to a step, as an object with its own state.

A stage acts at one or more of four points of the step, named in its ``phases``:

- ``select`` (producer, before the StepBatch is built): keep or replace the step's groups, e.g.
  DAPO's dynamic sampling generating more prompts;
- ``prepare`` (producer, on the StepBatch, before advantages): add a field, e.g. the critic's
  values, the greedy baseline, the per-token KL penalty;
- ``after_advantage`` (producer, on the StepBatch, once its advantages are set): change them, e.g.
  on-policy distillation adding its per-token term;
- ``after_update`` (consumer, after the policy update, on the trained batch): e.g. the critic's
  update, the adaptive KL coefficient.

Each returns the metrics it produced (``name -> value``), which reach ``metrics.jsonl``. A stage
that keeps state across steps returns it from ``state_dict``; it is saved in every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from postrl.types import ExperienceBatch, Prompt, RewardResult, Rollout, SamplingParams, StepBatch, TrainMetrics

Phase = Literal["select", "prepare", "after_advantage", "after_update"]
Need = Literal["critic", "reference"]  # a critic worker; the reference model in the trainer


@dataclass(frozen=True)
class Groups:
    """A step's prompts, rollouts and rewards before the StepBatch is built."""

    prompts: list[Prompt]
    rollouts: list[Rollout]
    rewards: list[RewardResult]


class StepServices(Protocol):
    """What a stage may ask of the step: more prompts, generations and scores (the Controller)."""

    sampling: SamplingParams

    def sample_prompts(self) -> list[Prompt]: ...

    def generate(self, prompts: list[Prompt], sampling: SamplingParams | None = None) -> list[Rollout]:
        """With the current weights; ``sampling`` defaults to the run's."""
        ...

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]: ...


class Stage:
    """Base of the step's stages. ``name`` keys the stage's seconds (``time/<name>_s``) and its
    state in checkpoints; ``phases`` lists the methods the step calls; ``needs`` what the run must
    hold for it (checked when the stages are chosen)."""

    name: ClassVar[str] = "stage"
    phases: ClassVar[tuple[Phase, ...]] = ()
    needs: ClassVar[frozenset[Need]] = frozenset()  # what the run must have for this stage to work

    def select(self, groups: Groups) -> tuple[Groups, dict[str, float]]:
        return groups, {}

    def prepare(self, step: StepBatch) -> dict[str, float]:
        return {}

    def after_advantage(self, step: StepBatch) -> dict[str, float]:
        return {}

    def after_update(self, batch: ExperienceBatch, train: TrainMetrics) -> dict[str, float]:
        return {}

    def timer_name(self, phase: Phase) -> str:
        return self.name

    def policy_waits(self, completed_steps: int) -> bool:
        """True when the policy is not to be updated in this step (e.g. while the critic warms up)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
