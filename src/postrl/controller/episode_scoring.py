"""``agent:`` runs: how their episodes are scored, whichever source ran them
(:class:`~postrl.controller.env_episodes.EnvEpisodes`,
:class:`~postrl.controller.function_episodes.AgentFunctionEpisodes`): by their environment, or by
the reward service on the transcript; an episode that failed is unscorable."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

from postrl.controller.failures import RewardFailureError
from postrl.controller.stages.base import Groups
from postrl.reward.requests import score_with
from postrl.types import Prompt, RewardResult, Rollout
from postrl.workers.roles import RewardService


class EpisodeScoring:
    """Scores a batch of episodes (``agent.reward``) and logs the failed ones' tracebacks."""

    def __init__(
        self, mode: Literal["environment", "service"], reward: RewardService, errors_log: Path | None = None
    ) -> None:
        """``errors_log``: where each failed episode's traceback is appended (None: nowhere)."""
        self.mode = mode
        self.reward = reward
        self.errors_log = errors_log

    @property
    def accuracy_component(self) -> str | None:
        return "environment" if self.mode == "environment" else self.reward.accuracy_component

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        """Each rollout's reward: its environment's (``agent.reward: environment``) or the reward
        service's on the transcript. An episode that failed (its environment or agent function raised,
        timed out or answered malformed) is unscorable with the failure as its reason, in either mode,
        and its traceback goes to ``episode_errors.log``."""
        self._log_failures(prompts, rollouts)
        if self.mode == "environment":
            return environment_rewards(rollouts)
        results: list[RewardResult | None] = [failed_result(r) for r in rollouts]
        todo = [i for i, res in enumerate(results) if res is None]
        scored = score_with(self.reward, prompts, [rollouts[i] for i in todo])
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


def environment_rewards(rollouts: list[Rollout]) -> list[RewardResult]:
    """The environment's reward of each rollout's episode; unscorable where it failed."""
    out = []
    for r in rollouts:
        failed = failed_result(r)
        reward = 0.0 if r.episode is None or r.episode.reward is None else r.episode.reward
        measures = {} if r.episode is None else r.episode.metrics
        # an episode cut at a limit before any reward is worth 0
        out.append(failed or RewardResult(reward, components={**measures, "environment": reward}))
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
