"""``agent.env`` runs: a batch's rollouts are whole episodes of an environment, played on the run's
rollout engine by an :class:`~postrl.rollout.agentic.episodes.EpisodeRunner` on the configured
schedule, and scored by :class:`~postrl.controller.episodes.EpisodeScoring`."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from postrl.config.agent import EnvAgent, EnvironmentEpisodes
from postrl.config.run import ConfigError
from postrl.controller.episode_scoring import EpisodeScoring, trainable
from postrl.controller.stages.base import Groups
from postrl.rollout.agentic.env_lookup import environment_factory
from postrl.rollout.agentic.episode_ops import EpisodeLimits, EpisodeSchedule
from postrl.rollout.agentic.episodes import EpisodeRunner
from postrl.rollout.agentic.individual import Individual
from postrl.rollout.agentic.limited import call_limited, failure_info, run_limited
from postrl.rollout.agentic.lockstep import Lockstep
from postrl.rollout.agentic.mcp_tools import McpServerError, McpTools
from postrl.rollout.agentic.openenv_server import LocalOpenEnvServer, OpenEnvServerError, local_app
from postrl.rollout.agentic.template_check import check_template, refuse_dropped_tools
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams
from postrl.workers.roles import RewardService, RolloutWorker

log = logging.getLogger(__name__)


def episode_limits(config: EnvironmentEpisodes) -> EpisodeLimits:
    return EpisodeLimits(
        config.max_turns,
        config.max_tokens_per_turn,
        config.max_context,
        config.on_turn_length == "end",
        config.env_timeout_s,
        config.env_workers,
    )


def local_openenv_server(spec: str) -> LocalOpenEnvServer | None:
    """The OpenEnv server an ``openenv:module:app`` spec names, started (None: the spec names none);
    one that does not start is a ConfigError naming the app."""
    app = local_app(spec)
    if app is None:
        return None
    try:
        return LocalOpenEnvServer(app)
    except OpenEnvServerError as exc:
        raise ConfigError(str(exc)) from None


def mcp_tools(config: EnvAgent) -> McpTools | None:
    """The run's MCP servers started, their tools listed and checked (None: it names none); a
    server that fails is a ConfigError naming it."""
    if not config.mcp_servers:
        return None
    try:
        tools = McpTools(config.mcp_servers)
    except (McpServerError, ValueError) as exc:
        raise ConfigError(f"agent.mcp_servers: {exc}") from None
    names = ", ".join(f"{s.name} ({len([t for t in tools.server_of.values() if t is s])} tools)" for s in tools.servers)
    log.info("agent: MCP servers %s", names)
    return tools


class EnvEpisodes:
    """The batch source of an ``agent.env`` run."""

    def __init__(
        self,
        config: EnvAgent,
        tokenizer: Any,
        rollout: RolloutWorker,
        reward: RewardService,
        errors_log: Path | None = None,
        model: str = "the model",
    ) -> None:
        """Finds the environment and checks, before the run starts, that one can be made and that its
        tools reach the prompt; a ConfigError names the field to change."""
        self.config = config
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.scoring = EpisodeScoring(config.reward, reward, errors_log)
        self.limits = episode_limits(config)
        self.mcp: McpTools | None = None
        self.server = local_openenv_server(config.env)
        try:
            try:
                make_env = environment_factory(config.env if self.server is None else f"openenv:{self.server.url}")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            self.mcp = mcp_tools(config)
            self.make_env = make_env if self.mcp is None else self.mcp.wrapping(make_env)
            self._check_tools(model)
        except BaseException:
            self.close()
            raise
        self._running: set[EpisodeRunner] = set()  # the runs in progress (suspend() reaches them)
        self._lock = threading.Lock()

    def _check_tools(self, model: str) -> None:
        config, tokenizer = self.config, self.tokenizer
        tools = self._probe_tools()
        report = check_template(tokenizer, tools or None)
        refuse_dropped_tools(report, tools, config.tools_in_prompt, model, f"agent.env={config.env}")
        summary = report.summary(config.on_prefix_break, bool(tools) and config.tools_in_prompt == "template")
        (log.info if report.append_only else log.warning)("agent: %s", summary)

    def _probe_tools(self) -> list[dict[str, Any]]:
        """The tool schemas of one environment made (and closed) before the run, within the time limit."""
        what = f"making agent.env={self.config.env}"
        try:
            probe = call_limited(lambda: self.make_env(**self.config.env_options), self.config.env_timeout_s, what)
        except Exception as exc:
            raise ConfigError(f"agent.env: {what} failed: {failure_info(exc, 'make')['env_error']}") from None
        try:
            return [t.schema for t in probe.tools]
        finally:
            run_limited([probe.close], self.config.env_timeout_s, 1, "environment close")

    @property
    def accuracy_component(self) -> str | None:
        return self.scoring.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        runner = self._runner(version)
        try:
            return runner.run(prompts, sampling)
        finally:
            self._finished(runner)

    def resume(
        self, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        """A batch a checkpoint suspended: its suspended episodes continued from their saved state."""
        runner = self._runner(version)
        try:
            return runner.resume(prompts, rollouts, sampling)
        finally:
            self._finished(runner)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        return self.scoring.score(prompts, rollouts)

    def trainable(self, groups: Groups, batch: int) -> Groups:
        return trainable(groups, batch)

    def suspend(self) -> bool:
        """A checkpoint: the episodes in progress stop at their next turn with their state saved
        (the engines cut the turns being generated); True when some were running."""
        with self._lock:
            runners = list(self._running)
        for runner in runners:
            runner.suspend()
        return self.rollout.suspend() or bool(runners)

    def close(self) -> None:
        """The run's MCP sessions and its OpenEnv server end here; its environments were closed with
        their episodes, the engine and the reward service close with the run's components."""
        if self.mcp is not None:
            self.mcp.close()
            self.mcp = None
        if self.server is not None:
            self.server.close()
            self.server = None

    def _schedule(self) -> EpisodeSchedule:
        if self.config.scheduling == "lockstep":
            return Lockstep()
        return Individual(self.rollout.joins_calls, self.config.max_concurrent_episodes)

    def _runner(self, version: int | None) -> EpisodeRunner:
        c = self.config
        runner = EpisodeRunner(
            lambda ps, sp: self.rollout.generate(ps, sp, version),
            self.make_env,
            self.tokenizer,
            self.limits,
            on_prefix_break=c.on_prefix_break,
            env_options=c.env_options,
            tools_in_prompt=c.tools_in_prompt,
            schedule=self._schedule(),
        )
        with self._lock:
            self._running.add(runner)
        return runner

    def _finished(self, runner: EpisodeRunner) -> None:
        with self._lock:
            self._running.discard(runner)
