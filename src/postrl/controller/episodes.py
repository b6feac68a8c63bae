"""``agent:`` runs: a batch's rollouts are whole episodes, scored by their environment or by the
reward service on the transcript."""

from __future__ import annotations

import logging
from typing import Any

from postrl.config.agent import AgentConfig
from postrl.rollout.agentic.env import environment_factory
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
from postrl.rollout.agentic.template_check import check_template
from postrl.rollout.base import RolloutWorker
from postrl.serve.agent_runs import RecordedAgents, load_agent_function
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams, ScoreRequest

log = logging.getLogger(__name__)


class EpisodeSource:
    """Whole episodes for a batch: an environment's (``agent.env``), or an OpenAI-API agent's
    recorded calls (``agent.function``)."""

    def __init__(self, config: AgentConfig, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.limits = EpisodeLimits(
            config.max_turns, config.max_tokens_per_turn, config.max_context, config.on_turn_length == "end"
        )
        self.agents: RecordedAgents | None = None
        if config.function is not None:
            self.function = load_agent_function(config.function)
            report = check_template(tokenizer)
        else:
            assert config.env is not None
            self.make_env = environment_factory(config.env)
            probe = self.make_env(**config.env_options)
            try:
                report = check_template(tokenizer, [t.schema for t in probe.tools] or None)
            finally:
                probe.close()
        (log.info if report.append_only else log.warning)("agent: %s", report.summary(config.on_prefix_break))

    def run(
        self, engine: RolloutWorker, prompts: list[Prompt], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        if self.config.function is not None:
            if self.agents is None:
                self.agents = RecordedAgents(engine, self.tokenizer, self.function, self.config.env_workers)
            return self.agents.run(prompts, sampling)
        runner = EpisodeRunner(
            lambda ps, sp: engine.generate(ps, sp, version),
            self.make_env,
            self.tokenizer,
            self.limits,
            self.config.on_prefix_break,
            self.config.env_workers,
            self.config.env_options,
        )
        try:
            return runner.run(prompts, sampling)
        finally:
            runner.close()

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()
            self.agents = None

    @property
    def scores_itself(self) -> bool:
        return self.config.reward == "environment"

    @staticmethod
    def rewards(rollouts: list[Rollout]) -> list[RewardResult]:
        """The environment's reward of each rollout's episode; unscorable where it gave none."""
        out = []
        for r in rollouts:
            reward = None if r.episode is None else r.episode.reward
            if reward is None and r.finish_reason != "env_error":  # cut at a limit before any reward: 0
                reward = 0.0
            if reward is None:
                error = r.episode.info.get("env_error", "") if r.episode is not None else ""
                out.append(RewardResult(None, error=f"the environment failed: {error}"))
            else:
                out.append(RewardResult(reward, components={"environment": reward}))
        return out

    @staticmethod
    def requests(prompts: list[Prompt], rollouts: list[Rollout]) -> list[ScoreRequest]:
        """For ``agent.reward: service``: the transcript of each episode, with its messages and the
        environment's info among the columns."""
        out = []
        for r in rollouts:
            p = prompts[r.prompt_index]
            assert r.episode is not None
            columns = {**p.columns, "messages": r.episode.messages, "env_info": r.episode.info}
            out.append(ScoreRequest(p.text, r.episode.transcript(), columns, len(r.response_ids)))
        return out
