"""What an episode schedule drives: the live episode, and the operations on it that the runner exposes.

A runner knows how an episode goes (its reset, its model turns, its environment's answers, its
training samples): :class:`~postrl.rollout.agentic.episodes.EpisodeRunner` an environment's
episode with one actor, :class:`~postrl.rollout.agentic.seated_games.SeatedGames` a game whose
seats are played by several policies. An :class:`EpisodeSchedule` decides when:
:class:`~postrl.rollout.agentic.lockstep.Lockstep` (every running episode's turn in one batch, then
every environment) or :class:`~postrl.rollout.agentic.individual.Individual` (each episode in a
thread of its own). A schedule reaches the runner only through :class:`EpisodeOps`, generic in the
runner's live episode and environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.env import Environment
from postrl.rollout.agentic.limited import Outcome
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.episode import EpisodeState, TrajectorySample, Turn

Generate = Callable[[list[Prompt], SamplingParams], list[Rollout]]
Job = tuple[int, Prompt]  # an episode to run: its prompt's index in the batch, and the prompt


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tokens_per_turn: int = 128
    max_context: int = 2048
    end_on_turn_length: bool = True  # False: a turn cut at max_tokens_per_turn still goes to the environment
    env_timeout_s: float | None = 60.0  # a reset, step or close that passes it ends its episode (None: no limit)
    env_workers: int = 8  # environment calls (resets, steps, closes) running at once


@dataclass
class LiveEpisode:
    prompt_index: int
    key: str
    env: Environment | None  # None when making it failed
    renderer: ChatRenderer  # the chat template, with the environment's tools where they go in the template
    messages: list[dict[str, Any]]
    seen: str  # the template text of the current sample's context
    sample: TrajectorySample
    done_samples: list[TrajectorySample] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)  # each model turn's message content
    rewards: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    breaks: int = 0
    finish: str | None = None
    env_s: float = 0.0
    generate_s: float = 0.0
    stream: int | None = None  # its random stream: turn t samples from derive(stream, t)


class Running(Protocol):
    """What a schedule reads of a live episode: whether it is over, and where its time went."""

    finish: str | None  # None: it goes on; "pending": its environment is to answer its model's turn
    env_s: float
    generate_s: float


LiveT = TypeVar("LiveT", bound=Running)
EnvT = TypeVar("EnvT")  # what the runner makes per episode (an environment, a seated game)
StepT = TypeVar("StepT")  # what that answers a turn with (a StepResult, a SeatStep)


class EpisodeOps(Protocol[LiveT, EnvT, StepT]):
    """The steps of an episode, for a schedule to call in its own order."""

    @property
    def limits(self) -> EpisodeLimits: ...

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """The engine's turns for ``prompts`` (each an episode's context)."""
        ...

    def reset_env(self, prompt: Prompt) -> tuple[EnvT, Any]:
        """A new environment and its first messages (an environment call); the reason its reset
        failed in their place."""
        ...

    def start(self, job: Job, outcome: Outcome[Any]) -> LiveT:
        """The episode after its reset (``outcome`` of :meth:`reset_env`); over when that failed."""
        ...

    def restore_env(self, state: EpisodeState) -> EnvT:
        """A new environment holding a suspended episode's state (an environment call)."""
        ...

    def restored(self, prompt_index: int, state: EpisodeState, env: EnvT) -> LiveT: ...

    def budget(self, e: LiveT) -> int:
        """New tokens the next turn may have; 0 ends the episode (its context is full)."""
        ...

    def turn_prompt(self, e: LiveT) -> Prompt: ...

    def record_generation(self, e: LiveT, r: Rollout) -> None:
        """The engine's turn checked against the trajectory and appended to it."""
        ...

    def step_env(self, e: LiveT) -> StepT:
        """The environment answering the model's last turn (an environment call)."""
        ...

    def observe(self, e: LiveT, outcome: Outcome[StepT]) -> None:
        """The environment's answer (``outcome`` of :meth:`step_env`) appended, or the episode over."""
        ...

    def rollouts(self, e: LiveT) -> list[Rollout]:
        """The finished episode's training samples."""
        ...

    def suspended(self, e: LiveT) -> Rollout | None:
        """The placeholder of the episode stopped here with its state saved; None where its
        environment cannot save its state (it runs on)."""
        ...

    def close_envs(self, envs: list[EnvT], timeout_s: float | None = None) -> list[str]:
        """The environments closed, within the limit; why each close that failed did."""
        ...


class EpisodeSchedule(Protocol):
    """When each episode's turns and environment calls happen."""

    def run(
        self,
        ops: EpisodeOps[LiveT, EnvT, StepT],
        jobs: list[Job],
        turn: SamplingParams,
        saved: list[EpisodeState] | None = None,
    ) -> list[Rollout]:
        """Every job's episode to its end, its rollouts in job order; ``saved[i]``: job i continues
        that suspended episode instead of starting one."""
        ...

    def suspend(self) -> None:
        """Ask the run in progress (another thread's) to stop its episodes at their next turn, saved."""
        ...
