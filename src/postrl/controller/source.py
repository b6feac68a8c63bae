"""Where a step's rollouts and their rewards come from: the rollout worker and the Reward Service
(:class:`SingleTurn`), or whole episodes of an ``agent:`` run (:class:`Episodes`). Training,
validation and ``postrl eval`` all go through a batch source."""

from __future__ import annotations

from typing import Protocol

from postrl.controller.episodes import EpisodeSource, trainable
from postrl.controller.stages.base import Groups
from postrl.reward.requests import score_with
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

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        """A result per rollout, in order; a sample that cannot be scored is unscorable, not an error."""
        ...

    def trainable(self, groups: Groups, batch: int) -> Groups:
        """The scored groups that have tokens to train on."""
        ...

    def close(self) -> None: ...


class SingleTurn:
    """One response per sample, from the rollout worker, scored by the Reward Service."""

    def __init__(self, rollout: RolloutWorker, reward: RewardService) -> None:
        self.rollout, self.reward = rollout, reward

    @property
    def accuracy_component(self) -> str | None:
        return self.reward.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        return self.rollout.generate(prompts, sampling, version)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        return score_with(self.reward, prompts, rollouts)

    def trainable(self, groups: Groups, batch: int) -> Groups:
        return groups

    def close(self) -> None:
        """The rollout worker and the Reward Service are closed with the run's components."""


class Episodes:
    """Whole episodes (``agent:``), scored by their environment or by the Reward Service on the
    transcript; an episode that failed before the model's first token is not trained on."""

    def __init__(self, episodes: EpisodeSource, rollout: RolloutWorker, reward: RewardService) -> None:
        self.episodes, self.rollout, self.reward = episodes, rollout, reward

    @property
    def accuracy_component(self) -> str | None:
        return "environment" if self.episodes.scores_itself else self.reward.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        return self.episodes.run(self.rollout, prompts, sampling, version)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        return self.episodes.score(prompts, rollouts, self.reward)

    def trainable(self, groups: Groups, batch: int) -> Groups:
        return trainable(groups, batch)

    def close(self) -> None:
        self.episodes.close()


def batch_source(rollout: RolloutWorker, reward: RewardService, episodes: EpisodeSource | None) -> BatchSource:
    return SingleTurn(rollout, reward) if episodes is None else Episodes(episodes, rollout, reward)
