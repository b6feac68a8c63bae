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
    part: int = 0
    env_s: float = 0.0
    generate_s: float = 0.0

    @property
    def tool_calls(self) -> int:
        return sum(len(t.tool_calls) for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(c.error is not None for t in self.turns for c in t.tool_calls)

    def transcript(self) -> str:
        """The conversation as text, one ``role: content`` block per message (for reward functions)."""
        return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in self.messages)
