"""The batch sources of a run with several policies (``policies:``): the episodes of one agent
function (:class:`~postrl.rollout.agentic.agent_function.RecordedAgents`) or of one seated game
(:class:`~postrl.rollout.agentic.seated_games.SeatedGames`), run once per batch with every policy's
engine answering its own turns, and each policy's rollouts handed to that policy's Controller
(:class:`PolicyEpisodes`), which scores, groups, trains and checkpoints them as a one-policy run
would. A policy's rollouts hold its own turns only."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from postrl.config.agent import FunctionAgent, SeatedAgent
from postrl.controller.episode_scoring import EpisodeScoring, trainable
from postrl.controller.stages.base import Groups
from postrl.rollout.agentic.agent_function import PolicyRollouts
from postrl.rollout.agentic.template_check import check_template
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams
from postrl.workers.roles import RewardService

log = logging.getLogger(__name__)


class PromptsDiffer(RuntimeError):
    """The policies' Controllers drew different prompts for one batch (their samplers diverged)."""


class EpisodesOfPolicies(Protocol):
    """What plays a batch's episodes with every policy acting in them."""

    @property
    def policies(self) -> list[str]: ...

    def run_policies(self, prompts: list[Prompt], sampling: SamplingParams) -> PolicyRollouts:
        """``sampling.n`` episodes of each prompt; each policy's rollouts, in prompt order."""
        ...

    def close(self) -> None: ...


@dataclass
class _Batch:
    prompts: list[Prompt]
    rollouts: PolicyRollouts


class SharedEpisodes:
    """The run's batches of episodes, in order: a batch runs when the first policy asks for it, and
    is kept until every policy has taken its own part (an async pipeline's policy asks for the next
    batch before the others have taken this one)."""

    def __init__(self, agents: EpisodesOfPolicies) -> None:
        """Takes over ``agents`` (closed by :meth:`close`)."""
        self.agents = agents
        self.policies = agents.policies
        self._batches: deque[_Batch] = deque()  # not yet taken by every policy, oldest first
        self._oldest = 0  # the number of the first batch kept
        self._taken = dict.fromkeys(self.policies, 0)  # batches each policy has taken
        self._lock = threading.Lock()
        self._closed = False

    def rollouts(self, policy: str, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """``policy``'s rollouts of its next batch (run now when no policy has asked for it yet)."""
        with self._lock:
            number = self._taken[policy]
            if number - self._oldest == len(self._batches):
                self._batches.append(_Batch(prompts, self.agents.run_policies(prompts, sampling)))
            batch = self._batches[number - self._oldest]
            if prompts != batch.prompts:
                raise PromptsDiffer(
                    f"policy {policy} drew other prompts for batch {number + 1} than the policy that ran it: "
                    "the policies' samplers must draw alike (the same data and seed)"
                )
            self._taken[policy] += 1
            while self._batches and min(self._taken.values()) > self._oldest:
                self._batches.popleft()
                self._oldest += 1
            return batch.rollouts[policy]

    def evaluate(self, prompts: list[Prompt], sampling: SamplingParams) -> PolicyRollouts:
        """Held-out episodes, every policy's rollouts, outside the batches (after the batch in
        flight, if any)."""
        with self._lock:
            return self.agents.run_policies(prompts, sampling)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.agents.close()


class PolicyEpisodes:
    """The batch source of one policy: its rollouts of the shared episodes, scored by their
    environment (the function's reward for this policy) or by the reward service."""

    def __init__(
        self,
        name: str,
        shared: SharedEpisodes,
        config: FunctionAgent | SeatedAgent,
        tokenizer: object,
        reward: RewardService,
        errors_log: Path | None = None,
    ) -> None:
        self.name = name
        self.shared = shared
        self.scoring = EpisodeScoring(config.reward, reward, errors_log)
        report = check_template(tokenizer)
        summary = report.summary(config.on_prefix_break, tools_shown=False)  # as for one policy's agent function
        (log.info if report.append_only else log.warning)("policy %s: %s", name, summary)

    @property
    def accuracy_component(self) -> str | None:
        return self.scoring.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        return self.shared.rollouts(self.name, prompts, sampling)

    def resume(
        self, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams, version: int | None
    ) -> list[Rollout]:
        raise RuntimeError("a run with several policies is sync: no batch is suspended to resume")

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        return self.scoring.score(prompts, rollouts)

    def trainable(self, groups: Groups, batch: int) -> Groups:
        """The rollouts with tokens to train on; none where this policy took no turn in the batch's
        episodes (a game that ended before its seat's turn): its step then trains nothing."""
        if not groups.rollouts:
            return groups
        return trainable(groups, batch)

    def suspend(self) -> bool:
        return False

    def close(self) -> None:
        self.shared.close()


class HeldOutEpisodes:
    """One validation round's episodes as policy ``name``'s batch source for the
    :class:`~postrl.run.validation.Validator`: each held-out set's episodes run once for every
    policy (by the first policy's validator to ask), scored by the policy's own source."""

    def __init__(self, name: str, source: PolicyEpisodes, ran: dict[int, PolicyRollouts]) -> None:
        """``ran``: the round's episodes by held-out set (the id of its prompt list), shared by the
        policies' views of one round."""
        self.name = name
        self.source = source
        self.ran = ran

    @property
    def accuracy_component(self) -> str | None:
        return self.source.accuracy_component

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]:
        if id(prompts) not in self.ran:
            self.ran[id(prompts)] = self.source.shared.evaluate(prompts, sampling)
        return self.ran[id(prompts)][self.name]

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        return self.source.score(prompts, rollouts)
