"""``agent.verifiers`` runs: a batch's rollouts are a verifiers environment's groups, played and
scored by the environment (:class:`~postrl.rollout.agentic.verifiers_env.VerifiersGroups`), their
calls recorded token by token."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from postrl.config.agent import VerifiersAgent
from postrl.config.run import ConfigError
from postrl.controller.episode_scoring import EpisodeScoring, trainable
from postrl.controller.stages.base import Groups
from postrl.rollout.agentic.template_check import check_template, refuse_dropped_tools
from postrl.rollout.agentic.verifiers_env import VerifiersGroups, tool_schemas
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams
from postrl.workers.roles import RewardService

log = logging.getLogger(__name__)


class VerifiersEpisodes:
    """The batch source of an ``agent.verifiers`` run."""

    def __init__(
        self,
        tokenizer: Any,
        groups: VerifiersGroups,
        reward: RewardService,
        agent: VerifiersAgent,
        errors_log: Path | None = None,
        model: str = "the model",
    ) -> None:
        """Takes over ``groups`` (closed by :meth:`close`); ``model``: its name in errors. The
        environment's tools shown through a template that drops them are refused."""
        self.groups = groups
        self.scoring = EpisodeScoring("environment", reward, errors_log)
        tools = tool_schemas(groups.env)
        report = check_template(tokenizer, tools or None)
        try:
            refuse_dropped_tools(report, tools, agent.tools_in_prompt, model, f"agent.verifiers={agent.verifiers}")
        except ConfigError:
            groups.close()
            raise
        summary = report.summary(agent.on_prefix_break, bool(tools) and agent.tools_in_prompt == "template")
        (log.info if report.append_only else log.warning)("agent: %s", summary)

    @property
    def accuracy_component(self) -> str | None:
        return self.scoring.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        """The environment's groups, on whatever weights the engines hold (its calls name no version)."""
        return self.groups.run(prompts, sampling)

    def resume(
        self, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        raise RuntimeError("a verifiers run's batches are never suspended (suspend() returns False): nothing to resume")

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        """The rubric's reward of each episode, its functions' values as components."""
        return self.scoring.score(prompts, rollouts)

    def trainable(self, groups: Groups, batch: int) -> Groups:
        return trainable(groups, batch)

    def suspend(self) -> bool:
        """A checkpoint waits for the groups in flight: a verifiers rollout's own state (its Python
        frames, its tools' state) cannot be saved and played again, and a group is scored whole."""
        return False

    def close(self) -> None:
        self.groups.close()
