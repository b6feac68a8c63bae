"""Many episodes through one rollout engine, turn by turn, into token-exact trajectories.

:class:`EpisodeRunner` knows how an episode goes: its environment's reset, each model turn, the
environment's answer, the training samples at its end. When each happens is its schedule's
(:mod:`.episode_ops`): :class:`~.individual.Individual` runs each episode in a thread of its own,
its turn going to the engine the moment its environment has answered (an episode waiting on a tool
holds no decode slot and delays no other); :class:`~.lockstep.Lockstep` generates every running
episode's turn in one batch, then steps their environments together. Either way the same seed
gives the same tokens: each episode's turns sample from its own random stream
(:func:`episode_jobs`, :mod:`postrl.rollout.streams`), whatever order they reach the engine in.

Each episode's prompt is its whole context, with a ``cache_key`` so an engine that keeps KV caches
continues from the last turn instead of prefilling again. The trajectory is the engine's tokens,
never re-tokenized text: a turn's prompt is the previous context plus the chat template's delta for
the new messages (:mod:`.chat`), the engine's prompt is checked against it, and only the model's
tokens are in the loss mask.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import replace
from typing import Any, Literal

from postrl.config.run import ConfigError
from postrl.rollout.agentic.chat import ChatRenderer, with_tools_system_message
from postrl.rollout.agentic.checks import check_messages, check_step_result
from postrl.rollout.agentic.env import Environment, EnvironmentFactory, SavableEnvironment, StepResult
from postrl.rollout.agentic.episode_ops import EpisodeLimits, EpisodeSchedule, Generate, Job, LiveEpisode
from postrl.rollout.agentic.limited import Outcome, failure_info, run_limited
from postrl.rollout.agentic.lockstep import Lockstep
from postrl.rollout.agentic.tools import checked_tools
from postrl.rollout.agentic.trajectory import PrefixPolicy, continue_context, episode_rollouts, record_turn
from postrl.rollout.streams import derive
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.episode import Episode, EpisodeState, TrajectorySample
from postrl.types.metric_names import AGENT

log = logging.getLogger(__name__)
_keys = itertools.count()


def episode_jobs(prompts: list[Prompt], n: int) -> list[tuple[int, Prompt]]:
    """The ``n`` episodes of each prompt, in order; episode k of a prompt with a random stream
    samples from its k-th (:mod:`postrl.rollout.streams`), whenever its turns reach the engine."""

    def own(p: Prompt, k: int) -> Prompt:
        return p if p.stream is None else replace(p, stream=derive(p.stream, k))

    return [(i, own(p, k)) for i, p in enumerate(prompts) for k in range(n)]


class EpisodeRunner:
    """Runs ``n`` episodes per prompt (a GRPO group of episodes) to their end, as its schedule says;
    it is the :class:`~.episode_ops.EpisodeOps` its schedule drives."""

    def __init__(
        self,
        generate: Generate,
        make_env: EnvironmentFactory,
        tokenizer: Any,
        limits: EpisodeLimits,
        on_prefix_break: PrefixPolicy = "split",
        env_options: dict[str, Any] | None = None,
        tools_in_prompt: Literal["template", "system", "none"] = "template",
        schedule: EpisodeSchedule | None = None,
    ) -> None:
        """``schedule``: when each episode's turns happen (None: :class:`~.lockstep.Lockstep`)."""
        self._generate = generate
        self.make_env = make_env
        self.tokenizer = tokenizer
        self._limits = limits
        self.on_prefix_break = on_prefix_break
        self.env_options = env_options or {}
        self.tools_in_prompt = tools_in_prompt
        self.schedule = schedule or Lockstep()
        self.tools_checked = False  # the first environment made has had its tools checked

    @property
    def limits(self) -> EpisodeLimits:
        return self._limits

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        return self._generate(prompts, sampling)

    def run(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """``sampling.n`` episodes of each prompt, their rollouts grouped by prompt, in order."""
        return self.schedule.run(self, episode_jobs(prompts, sampling.n), self._turn_sampling(sampling))

    def suspend(self) -> None:
        """Ask the episodes of a run in progress (another thread's) to stop at their next turn with
        their state saved (an individually scheduled run; see :mod:`.individual`)."""
        self.schedule.suspend()

    def resume(self, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams) -> list[Rollout]:
        """A batch a checkpoint suspended: its suspended episodes continued from their saved state,
        the others as they were; grouped by prompt."""
        states = {i: r.episode.saved for i, r in enumerate(rollouts) if r.episode is not None and r.episode.saved}
        jobs = [(rollouts[i].prompt_index, prompts[rollouts[i].prompt_index]) for i in states]
        continued = self.schedule.run(self, jobs, self._turn_sampling(sampling), list(states.values()))
        kept = [r for i, r in enumerate(rollouts) if i not in states]
        return sorted(kept + continued, key=lambda r: r.prompt_index)

    def suspended(self, e: LiveEpisode) -> Rollout | None:
        """The placeholder of a suspended episode in its batch (no tokens yet, its saved state);
        None where its environment cannot save its state."""
        if not isinstance(e.env, SavableEnvironment):
            return None
        state = EpisodeState(
            e.key,
            e.messages,
            e.seen,
            e.sample,
            e.done_samples,
            e.turns,
            e.contents,
            e.rewards,
            e.info,
            e.breaks,
            e.env_s,
            e.generate_s,
            e.env.state_dict(),
            e.stream,
        )
        episode = Episode(e.messages, e.turns, None, "suspended", info=e.info, saved=state)
        return Rollout(e.prompt_index, list(e.sample.prompt_ids), [], [], "", "suspended", 0, episode=episode)

    def restore_env(self, state: EpisodeState) -> Environment:
        """A new environment holding a suspended episode's state (in place of its reset)."""
        env = self.make_env(**self.env_options)
        if not isinstance(env, SavableEnvironment) or state.env_state is None:
            env.close()
            raise TypeError(f"{type(env).__name__} cannot load the saved state of a suspended episode")
        env.load_state_dict(state.env_state)
        return env

    def restored(self, prompt_index: int, state: EpisodeState, env: Environment) -> LiveEpisode:
        s = state
        return LiveEpisode(
            prompt_index,
            s.key,
            env,
            self.renderer_for(env),
            s.messages,
            s.seen,
            s.sample,
            s.done_samples,
            s.turns,
            s.contents,
            s.rewards,
            s.info,
            s.breaks,
            None,
            s.env_s,
            s.generate_s,
            s.stream,
        )

    def _turn_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """One model turn: one sample, ending at the template's end of turn or a tool call's end."""
        stop_ids = set(sampling.stop_token_ids) | set(self.renderer_for(None).end_of_turn_ids())
        return replace(sampling, n=1, stop_token_ids=tuple(sorted(stop_ids)), stop=(*sampling.stop, "</tool_call>"))

    def close_envs(self, envs: list[Environment], timeout_s: float | None = None) -> list[str]:
        """Every episode's environment closed, within the time limit; why each close that failed did."""
        limit = self.limits.env_timeout_s if timeout_s is None else timeout_s
        outcomes = run_limited([env.close for env in envs], limit, self.limits.env_workers, "environment close")
        return [failure_info(o.error, "close")["env_error"] for o in outcomes if o.error is not None]

    def renderer_for(self, env: Environment | None) -> ChatRenderer:
        """The chat template with the environment's tools (none: they are in the system message)."""
        tools = [t.schema for t in env.tools] if env is not None and self.tools_in_prompt == "template" else None
        return ChatRenderer(self.tokenizer, tools)

    def check_tools(self, env: Environment) -> None:
        """The environment's tools have distinct names and valid JSON-schema parameters (a built-in
        environment's ToolBox checks its own; a custom one's are checked here, once)."""
        try:
            checked_tools(list(env.tools))
        except ValueError as exc:
            raise ConfigError(f"environment {type(env).__name__}: {exc}") from None
        self.tools_checked = True

    def reset_env(self, prompt: Prompt) -> tuple[Environment, list[dict[str, Any]] | Exception]:
        """A new environment and its first messages, or, once it is made, the reason its reset failed
        (the environment is returned either way: its close() is still owed)."""
        env = self.make_env(**self.env_options)
        row = {**prompt.columns, "prompt": prompt.question, "messages": prompt.messages}
        try:
            return env, check_messages(env.reset(row), "reset() messages")
        except Exception as exc:
            return env, exc

    def start(self, job: Job, outcome: Outcome[Any]) -> LiveEpisode:
        """The episode after its reset; one whose environment could not be made or reset is over
        (env_error) before its first turn."""
        index, prompt = job
        env, messages = outcome.value if outcome.value is not None else (None, outcome.error)
        if env is None or not isinstance(messages, list):
            key = f"episode-{next(_keys)}"
            failed = LiveEpisode(
                index, key, env, self.renderer_for(None), [], "", TrajectorySample([]), finish="env_error"
            )
            assert isinstance(messages, BaseException)
            failed.info.update(failure_info(messages, "reset"))
            return failed
        if not self.tools_checked:
            self.check_tools(env)
        if self.tools_in_prompt == "system" and env.tools:
            messages = with_tools_system_message(messages, [t.schema for t in env.tools])
        renderer = self.renderer_for(env)
        text = renderer.render(messages, generation_prompt=True)
        ids = renderer.encode(text)
        if len(ids) >= self.limits.max_context:
            where = f" {prompt.source}" if prompt.source else ""
            raise ConfigError(
                f"prompt{where} renders to {len(ids)} tokens: agent.max_context={self.limits.max_context} leaves no "
                "room for a turn"
            )
        key = f"episode-{next(_keys)}"
        return LiveEpisode(index, key, env, renderer, messages, text, TrajectorySample(ids), stream=prompt.stream)

    def budget(self, e: LiveEpisode) -> int:
        """New tokens the episode's next turn may have; 0: its context is full (it ends, max_context)."""
        budget = min(self.limits.max_tokens_per_turn, self.limits.max_context - len(e.sample.context))
        if budget <= 0:
            e.finish = "max_context"
        return max(budget, 0)

    @staticmethod
    def turn_prompt(e: LiveEpisode) -> Prompt:
        stream = None if e.stream is None else derive(e.stream, len(e.turns))
        return Prompt(e.seen, e.sample.context, cache_key=e.key, stream=stream)

    @staticmethod
    def step_env(e: LiveEpisode) -> StepResult:
        """The episode's environment answering the model's last turn, checked."""
        assert e.env is not None
        return check_step_result(e.env.step(e.contents[-1]))

    def record_generation(self, e: LiveEpisode, r: Rollout) -> None:
        record_turn(e, r, self.limits)

    def observe(self, e: LiveEpisode, outcome: Outcome[StepResult]) -> None:
        """The environment's answer to the model's last turn; a failure, a time-out or a malformed
        answer ends the episode (env_error: unscorable, the reason in ``info``)."""
        if outcome.error is not None:
            e.finish = "env_error"
            e.info.update(failure_info(outcome.error, "step"))
            return
        result, content = outcome.value, e.contents[-1]
        assert result is not None
        turn = e.turns[-1]
        turn.reward, turn.tool_calls = result.reward, result.tool_calls
        if result.reward is not None:
            e.rewards.append(result.reward)
        e.info.update(result.info)
        history = [*e.messages, {"role": "assistant", "content": content}]
        e.messages = history + result.messages
        if result.done:
            e.finish = "stop"
            return
        if len(e.turns) >= self.limits.max_turns:
            e.finish = "max_turns"
            return
        e.finish = None
        continue_context(e, result.messages, self.on_prefix_break)

    def rollouts(self, e: LiveEpisode) -> list[Rollout]:
        """The finished episode's training samples."""
        return episode_rollouts(e)

    def close(self) -> None:
        """Nothing to free: the environments of a run are closed at its end."""


def episode_metrics(rollouts: list[Rollout], prefix: str = AGENT) -> dict[str, float]:
    """The step's ``agent/*`` metrics from its rollouts' episodes (each episode counted once)."""
    episodes = [r.episode for r in rollouts if r.episode is not None and r.episode.part == 0]
    if not episodes:
        return {}
    n = len(episodes)
    finishes = Counter(ep.finish_reason for ep in episodes)
    dropped: Counter[str] = Counter()
    for ep in episodes:
        dropped.update(ep.dropped)
    parts = sum(1 for r in rollouts if r.episode is not None)
    values = {
        "turns_mean": sum(len(ep.turns) for ep in episodes) / n,
        "tool_calls": float(sum(ep.tool_calls for ep in episodes)),
        "tool_errors": float(sum(ep.tool_errors for ep in episodes)),
        "episode_tokens_mean": sum(len(r.response_ids) for r in rollouts if r.episode) / n,
        "prefix_breaks": float(sum(ep.prefix_breaks for ep in episodes)),
        "history_edits": float(sum(sum(ep.history_edits.values()) for ep in episodes)),
        "reruns": float(sum(ep.info.get("rerun", 0) for ep in episodes)),
        "replayed_calls": float(sum(ep.info.get("replayed_calls", 0) for ep in episodes)),
        "samples_per_episode": parts / n,
        "env_s": sum(ep.env_s for ep in episodes),
        "generate_s": max(ep.generate_s for ep in episodes),
        **{f"finish_{reason}": count / n for reason, count in sorted(finishes.items())},
        **{f"dropped_{reason}": float(count) for reason, count in sorted(dropped.items())},
    }
    return {f"{prefix}/{name}": value for name, value in values.items()}
