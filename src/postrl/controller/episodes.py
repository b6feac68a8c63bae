"""``agent:`` runs: a batch's rollouts are whole episodes, scored by their environment or by the
reward service on the transcript."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from postrl.config.agent import AgentConfig
from postrl.config.run import ConfigError
from postrl.controller.failures import RewardFailureError
from postrl.controller.stages.base import Groups
from postrl.reward.requests import score_with
from postrl.rollout.agentic.env_lookup import environment_factory
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
from postrl.rollout.agentic.limited import call_limited, failure_info, run_limited
from postrl.rollout.agentic.template_check import check_template
from postrl.serve.agent_runs import RecordedAgents, load_agent_function
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams
from postrl.workers.roles import RewardService, RolloutWorker

log = logging.getLogger(__name__)


class EpisodeSource:
    """Whole episodes for a batch: an environment's (``agent.env``), or an OpenAI-API agent's
    recorded calls (``agent.function``)."""

    def __init__(
        self, config: AgentConfig, tokenizer: Any, errors_log: Path | None = None, model: str = "the model"
    ) -> None:
        """Finds the environment (or agent function) and checks, before the run starts, that one can be
        made and that its tools reach the prompt; a ConfigError names the field to change."""
        self.config = config
        self.tokenizer = tokenizer
        self.errors_log = errors_log
        self.limits = EpisodeLimits(
            config.max_turns,
            config.max_tokens_per_turn,
            config.max_context,
            config.on_turn_length == "end",
            config.env_timeout_s,
        )
        self.agents: RecordedAgents | None = None
        self._runners: set[EpisodeRunner] = set()  # the runs in progress (suspend() reaches them)
        if config.function is not None:
            self.function = load_agent_function(config.function)
            report = check_template(tokenizer)
        else:
            assert config.env is not None
            try:
                self.make_env = environment_factory(config.env)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            tools = self._probe_tools()
            report = check_template(tokenizer, tools or None)
            if tools and not report.tools_rendered and config.tools_in_prompt == "template":
                names = ", ".join(t["function"]["name"] for t in tools)
                raise ConfigError(
                    f"agent.tools_in_prompt=template: the chat template of {model} ignores tools=, so the model "
                    f"would never see the tools of agent.env={config.env} ({names}); set agent.tools_in_prompt: "
                    "system (postrl writes them into a system message), none (the model was trained on them) or use a "
                    "model whose template renders tools"
                )
        (log.info if report.append_only else log.warning)("agent: %s", report.summary(config.on_prefix_break))

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

    def run(
        self, engine: RolloutWorker, prompts: list[Prompt], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        if self.config.function is not None:
            if self.agents is None:
                c = self.config
                self.agents = RecordedAgents(
                    engine, self.tokenizer, self.function, c.env_workers, c.function_timeout_s, c.tools_in_prompt
                )
            return self.agents.run(prompts, sampling)
        runner = self._runner(engine, version)
        try:
            return runner.run(prompts, sampling)
        finally:
            self._runners.discard(runner)
            runner.close()

    def resume(
        self,
        engine: RolloutWorker,
        prompts: list[Prompt],
        rollouts: list[Rollout],
        sampling: SamplingParams,
        version: int | None,
    ) -> list[Rollout]:
        """A batch a checkpoint suspended: its suspended episodes continued from their saved state."""
        if self.config.function is not None:
            raise ValueError("agent.function episodes are not suspended, so none are resumed")
        runner = self._runner(engine, version)
        try:
            return runner.resume(prompts, rollouts, sampling)
        finally:
            self._runners.discard(runner)
            runner.close()

    def suspend(self, engine: RolloutWorker) -> bool:
        """A checkpoint: the episodes in progress stop at their next turn with their state saved
        (the engines cut the turns being generated); True when some were running."""
        runners = list(self._runners)
        for runner in runners:
            runner.suspend()
        return engine.suspend() or bool(runners)

    def _runner(self, engine: RolloutWorker, version: int | None) -> EpisodeRunner:
        runner = EpisodeRunner(
            lambda ps, sp: engine.generate(ps, sp, version),
            self.make_env,
            self.tokenizer,
            self.limits,
            self.config.on_prefix_break,
            self.config.env_workers,
            self.config.env_options,
            self.config.tools_in_prompt,
            self.config.scheduling,
            engine.joins_calls,
            self.config.max_concurrent_episodes,
        )
        self._runners.add(runner)
        return runner

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()
            self.agents = None

    @property
    def scores_itself(self) -> bool:
        return self.config.reward == "environment"

    def score(self, prompts: list[Prompt], rollouts: list[Rollout], reward: RewardService) -> list[RewardResult]:
        """Each rollout's reward: its environment's (``agent.reward: environment``) or the reward
        service's on the transcript. An episode that failed (its environment or agent function raised,
        timed out or answered malformed) is unscorable with the failure as its reason, in either mode,
        and its traceback goes to ``episode_errors.log``."""
        self._log_failures(prompts, rollouts)
        if self.scores_itself:
            return self.rewards(rollouts)
        results: list[RewardResult | None] = [failed_result(r) for r in rollouts]
        todo = [i for i, res in enumerate(results) if res is None]
        scored = score_with(reward, prompts, [rollouts[i] for i in todo])
        for i, res in zip(todo, scored, strict=True):
            results[i] = res
        return [res for res in results if res is not None]

    def _log_failures(self, prompts: list[Prompt], rollouts: list[Rollout]) -> None:
        failed = [
            r for r in rollouts if r.episode is not None and r.episode.part == 0 and "env_error" in r.episode.info
        ]
        if not failed or self.errors_log is None:
            return
        self.errors_log.parent.mkdir(parents=True, exist_ok=True)
        with self.errors_log.open("a") as f:
            for r in failed:
                assert r.episode is not None
                info = r.episode.info
                f.write(f"--- prompt {prompts[r.prompt_index].source or r.prompt_index}: {failure_reason(r)}\n")
                f.write(info.get("env_traceback", "") or "(no traceback: the call was abandoned)\n")

    @staticmethod
    def rewards(rollouts: list[Rollout]) -> list[RewardResult]:
        """The environment's reward of each rollout's episode; unscorable where it failed."""
        out = []
        for r in rollouts:
            failed = failed_result(r)
            reward = 0.0 if r.episode is None or r.episode.reward is None else r.episode.reward
            # an episode cut at a limit before any reward is worth 0
            out.append(failed or RewardResult(reward, components={"environment": reward}))
        return out


def failure_reason(r: Rollout) -> str:
    """Why the rollout's episode failed: where (reset, step, the agent function) and the error."""
    assert r.episode is not None
    return str(r.episode.info["env_reason"])


def failed_result(r: Rollout) -> RewardResult | None:
    """The unscorable result of a rollout whose episode failed; None for one that did not."""
    if r.episode is None or "env_error" not in r.episode.info:
        return None
    return RewardResult(None, error=failure_reason(r))


def trainable(groups: Groups, step: int) -> Groups:
    """The scored rollouts that have tokens to train on: an episode that failed before the model's
    first token was counted and saved, and is left out here. A step left with none stops the run."""
    keep = [i for i, r in enumerate(groups.rollouts) if r.response_ids]
    if not keep:
        reasons = Counter(res.error for res in groups.rewards if res.error).most_common(1)
        first = f": {reasons[0][0]}" if reasons else ""
        raise RewardFailureError(f"step {step}: no episode got as far as a model turn, nothing to train on{first}")
    if len(keep) == len(groups.rollouts):
        return groups
    return Groups(groups.prompts, [groups.rollouts[i] for i in keep], [groups.rewards[i] for i in keep])
