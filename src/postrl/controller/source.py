"""Where a step's rollouts and their rewards come from: the rollout worker and the Reward Service
(:class:`SingleTurn`), or whole episodes of an ``agent:`` run
(:class:`~postrl.controller.env_episodes.EnvEpisodes`,
:class:`~postrl.controller.function_episodes.AgentFunctionEpisodes`). Training, validation and
``postrl eval`` all go through a batch source, built once per run
(:func:`postrl.run.batch_sources.make_batch_source`)."""

from __future__ import annotations

from typing import Any, Protocol

from postrl.controller.stages.base import Groups
from postrl.reward.requests import score_with
from postrl.rollout.common import generate_shown
from postrl.rollout.continuation import continue_rollouts
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams
from postrl.workers.roles import RewardService, RolloutWorker


class BatchSource(Protocol):
    @property
    def accuracy_component(self) -> str | None:
        """The reward component that is the ``accuracy`` metric."""
        ...

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        """Rollouts of ``prompts`` on weight ``version`` (None: whatever the engines hold)."""
        ...

    def resume(
        self, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        """A batch an async run's checkpoint suspended (``finish_reason="suspended"``), continued."""
        ...

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        """A result per rollout, in order; a sample that cannot be scored is unscorable, not an error."""
        ...

    def trainable(self, groups: Groups, batch: int) -> Groups:
        """The scored groups that have tokens to train on."""
        ...

    def suspend(self) -> bool:
        """A checkpoint of an async run: the generation in progress returns what it has, to be
        resumed (True when one was running)."""
        ...

    def close(self) -> None: ...


class SingleTurn:
    """One response per sample, from the rollout worker, scored by the Reward Service."""

    def __init__(self, rollout: RolloutWorker, reward: RewardService, tokenizer: Any = None) -> None:
        """``tokenizer``: the text of a continued response (see :meth:`resume`)."""
        self.rollout = rollout
        self.reward = reward
        self.tokenizer = tokenizer

    @property
    def accuracy_component(self) -> str | None:
        return self.reward.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        return generate_shown(self.rollout, prompts, sampling, version)

    def resume(
        self, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        """Each suspended response continued from its prefix."""
        if self.tokenizer is None:
            raise ValueError("SingleTurn needs the tokenizer to continue suspended rollouts")
        return continue_rollouts(
            lambda ps, sp: self.rollout.generate(ps, sp, version), prompts, rollouts, sampling, self.tokenizer
        )

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        return score_with(self.reward, prompts, rollouts)

    def trainable(self, groups: Groups, batch: int) -> Groups:
        return groups

    def suspend(self) -> bool:
        return self.rollout.suspend()

    def close(self) -> None:
        """The rollout worker and the Reward Service are closed with the run's components."""
