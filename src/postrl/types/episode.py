"""What a multi-turn episode did, turn by turn: carried by its rollout to the reward, the metrics
and the samples file (``Rollout.episode``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCallRecord:
    """One tool call parsed from the model's turn. ``error``: why it failed (the model was told)."""

    name: str
    arguments: dict[str, Any] | None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Turn:
    """One model turn: the context it started from, what it generated, what came back."""

    context_tokens: int
    generated_tokens: int
    observation_tokens: int = 0
    reward: float | None = None  # a per-turn reward from the environment, if it gave one
    tool_calls: list[ToolCallRecord] = field(default_factory=list)


@dataclass
class Episode:
    """A whole episode. ``reward``: the environment's (the sum of its step rewards, None when it
    gave none: the reward service scores the transcript). ``finish_reason``: ``done`` (the
    environment ended it), ``length`` (a turn hit max_tokens_per_turn), ``max_turns``,
    ``max_context``, ``suspended`` or ``env_error``. ``prefix_breaks``: turns where the chat template
    rewrote the history (``agent.on_prefix_break``). ``part``: with ``on_prefix_break: split``, which
    training sample of the episode this rollout is (from 0)."""

    messages: list[dict[str, Any]]
    turns: list[Turn]
    reward: float | None
    finish_reason: str
    info: dict[str, Any] = field(default_factory=dict)
    prefix_breaks: int = 0
    # training samples of the episode not trained on, by reason: "no_model_tokens" (a split left a
    # sample the model never wrote into, e.g. a prefix break right before a limit)
    dropped: dict[str, int] = field(default_factory=dict)
    # recorded agents' requests kept on the episode's tokens through a framework's edits of the history,
    # by kind (postrl.rollout.agentic.history_match.EDITS), and "reasoning_split": turns whose template
    # dropped earlier reasoning, trained from what the template showed the model
    history_edits: dict[str, int] = field(default_factory=dict)
    part: int = 0
    env_s: float = 0.0
    generate_s: float = 0.0
    saved: EpisodeState | None = None  # finish_reason "suspended": what the episode continues from
    seat: str | None = None  # a seated game's: the seat whose turns this sample holds (agent.seats)
    # an agent.function episode a checkpoint suspended: its completed model calls, replayed when it re-runs
    calls: RecordedCalls | None = None
    # the environment's own per-episode measures (a verifiers rubric's functions' values), each a
    # reward/<name> metric beside the reward (controller/episode_scoring.py)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def tool_calls(self) -> int:
        return sum(len(t.tool_calls) for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(c.error is not None for t in self.turns for c in t.tool_calls)

    def transcript(self) -> str:
        """The conversation as text, one ``role: content`` block per message (for reward functions)."""
        return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in self.messages)


@dataclass
class TrajectorySample:
    """One training sample of an episode: its first context and everything after it (the model's
    tokens with their logprobs and versions, the inserted ones with 0)."""

    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cache_versions: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response

    def add(self, ids: list[int], logprobs: list[float], own: list[int], cache: list[int], generated: bool) -> None:
        self.response += ids
        self.logprobs += logprobs
        self.mask += [int(generated)] * len(ids)
        self.versions += own
        self.cache_versions += cache


@dataclass
class EpisodeState:
    """An episode a checkpoint suspended between two turns: what it has so far and its
    environment's own state (``SavableEnvironment.state_dict()``), all plain data, so it is saved
    with the checkpoint and continued after a restart. A turn the checkpoint cut is generated again
    from its start (the environment never saw its tokens)."""

    key: str
    messages: list[dict[str, Any]]
    seen: str
    sample: TrajectorySample
    done_samples: list[TrajectorySample]
    turns: list[Turn]
    contents: list[str]
    rewards: list[float]
    info: dict[str, Any]
    breaks: int
    env_s: float
    generate_s: float
    env_state: dict[str, Any] | None  # None: the environment failed before (the episode is over)
    stream: int | None = None  # its random stream (postrl.rollout.streams), for the turns to come


@dataclass
class ModelCall:
    """One completed engine call of a recorded agent: the exact prompt and each choice's answer."""

    prompt_ids: list[int]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    kv_versions: list[list[int]]
    finish_reasons: list[str]
    weight_version: int


@dataclass
class RecordedCalls:
    """An ``agent.function`` episode a checkpoint suspended. The function's own state (its Python
    frames) cannot be saved, so it runs again from its start under the same episode id; each model
    call whose prompt is exactly the next recorded call's is answered from here (the same tokens,
    logprobs and versions, no engine work), and from the first call that differs on the engine."""

    episode_id: str
    calls: list[ModelCall]


def turn_of_state(state: dict[str, Any]) -> Turn:
    calls = [ToolCallRecord(**c) for c in state.get("tool_calls", [])]
    return Turn(**{**state, "tool_calls": calls})


def episode_of_state(state: dict[str, Any]) -> Episode:
    """An Episode from its plain form (``dataclasses.asdict``), nested records rebuilt."""
    saved = state.get("saved")
    if saved is not None:
        saved = EpisodeState(
            **{
                **saved,
                "sample": TrajectorySample(**saved["sample"]),
                "done_samples": [TrajectorySample(**s) for s in saved["done_samples"]],
                "turns": [turn_of_state(t) for t in saved["turns"]],
            }
        )
    calls = state.get("calls")
    if calls is not None:
        calls = RecordedCalls(calls["episode_id"], [ModelCall(**c) for c in calls["calls"]])
    turns = [turn_of_state(t) for t in state["turns"]]
    return Episode(**{**state, "turns": turns, "saved": saved, "calls": calls})
