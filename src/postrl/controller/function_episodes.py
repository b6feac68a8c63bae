"""``agent.function`` runs: a batch's rollouts are the recorded model calls of the user's agent
function (:class:`~postrl.rollout.agentic.agent_function.RecordedAgents`), scored by
:class:`~postrl.controller.episodes.EpisodeScoring`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from postrl.config.agent import FunctionAgent
from postrl.controller.episode_scoring import EpisodeScoring, trainable
from postrl.controller.stages.base import Groups
from postrl.rollout.agentic.agent_function import RecordedAgents
from postrl.rollout.agentic.template_check import check_template
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams
from postrl.workers.roles import RewardService, RolloutWorker

log = logging.getLogger(__name__)


class AgentFunctionEpisodes:
    """The batch source of an ``agent.function`` run."""

    def __init__(
        self,
        config: FunctionAgent,
        tokenizer: Any,
        agents: RecordedAgents,
        rollout: RolloutWorker,
        reward: RewardService,
        errors_log: Path | None = None,
    ) -> None:
        """Takes over ``agents`` (closed by :meth:`close`)."""
        self.agents = agents
        self.rollout = rollout
        self.scoring = EpisodeScoring(config.reward, reward, errors_log)
        report = check_template(tokenizer)
        # the function's tools are known only at its calls: a call with tools= on a template that drops them
        # is refused there, naming agent.tools_in_prompt
        summary = report.summary(config.on_prefix_break, tools_shown=False)
        (log.info if report.append_only else log.warning)("agent: %s", summary)

    @property
    def accuracy_component(self) -> str | None:
        return self.scoring.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        """The function's episodes, on whatever weights the engines hold (its calls name no version)."""
        return self.agents.run(prompts, sampling)

    def resume(
        self, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        """A batch a checkpoint suspended: its unfinished episodes run again from their start, their
        recorded model calls replayed (:meth:`RecordedAgents.rerun`)."""
        return self.agents.rerun(prompts, rollouts)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        return self.scoring.score(prompts, rollouts)

    def trainable(self, groups: Groups, batch: int) -> Groups:
        return trainable(groups, batch)

    def suspend(self) -> bool:
        """A checkpoint: the episodes in progress stop at their next model call (the engines cut the
        calls being generated) and come back suspended with their recorded calls."""
        self.agents.suspend()
        self.rollout.suspend()
        return True

    def close(self) -> None:
        self.agents.close()
