"""The records one RL step passes along: prompts, sampling parameters, rollouts, rewards, experiences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from postrl.types.episode import Episode
from postrl.types.metric_names import BUFFER_DROPPED, BUFFER_LAG_MAX, BUFFER_LAG_MEAN

TASK_COLUMN = "task_type"  # the column that names a row's task (per-task figures, applies_to, curricula)


@dataclass
class Prompt:
    """One prompt, tokenized, with the dataset row's other columns for the reward function."""

    text: str
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # "file:line", for error messages
    messages: list[dict[str, Any]] | None = None  # the chat messages the prompt was rendered from
    # an episode's id for the engine: it keeps this sequence's KV cache after the generate and
    # continues from it when the next call's prompt extends it (multi-turn); with n > 1 sample k is
    # kept as f"{cache_key}#{k}"
    cache_key: str | None = None
    # the random stream its samples are drawn from (postrl.rollout.streams), named by the run's
    # prompt draw from the seed and the prompt's place in the draw; None: the engine picks one
    stream: int | None = None
    # which of the run's policies answers it (a seated game's acting seat's); None: the run's only one
    policy: str | None = None

    @property
    def task_type(self) -> str | None:
        """The row's ``task_type`` column (e.g. math, code), None when absent."""
        return self.columns.get(TASK_COLUMN)

    @property
    def question(self) -> str:
        """What an agent or environment is asked: the last user message of a chat prompt (``text``
        is the chat template's rendering of it, which an agent would wrap in a template again),
        else ``text``."""
        users = [
            m["content"] for m in self.messages or [] if m.get("role") == "user" and isinstance(m.get("content"), str)
        ]
        return users[-1] if users else self.text

    @property
    def answer(self) -> Any:
        """The row's ``answer`` column (what a verifier compares against), None when absent."""
        return self.columns.get("answer")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # also return this many most likely tokens (id, logprob) at every position


# suspended: the engine stopped mid-response when asked (a checkpoint of an async run); the rollout
# holds the tokens so far and is continued by postrl.rollout.continuation.continue_rollouts
# max_turns, max_context: a multi-turn episode hit that limit (postrl.rollout.agentic)
FinishReason = Literal["stop", "length", "suspended", "max_turns", "max_context", "env_error"]


@dataclass
class Rollout:
    """One sampled response. ``logprobs`` are pi_old's, one per response token."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    weight_version: int
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, with SamplingParams.top_logprobs
    # the weight version behind each token's logprob; None: all ``weight_version`` (an engine that
    # takes new weights in the middle of a response fills it in)
    logprob_versions: list[int] | None = None
    engine: str | None = None  # the engine that generated it (a pool's engine name)
    # per token, the oldest weight version behind the KV cache it attended to (an engine that keeps
    # the cache across an in-flight update); None: the same as logprob_versions
    kv_versions: list[int] | None = None
    # per response token, 1 where the model generated it and 0 where the environment or the chat
    # template inserted it (a multi-turn episode's tool output); None: all the model's
    loss_mask: list[int] | None = None
    episode: Episode | None = None  # a multi-turn episode's turns, tool calls and reward

    def token_versions(self) -> list[int] | None:
        """Per token, the oldest weights behind its logprob (its own, or its cache's); None when all
        are ``weight_version``."""
        if self.kv_versions is None:
            return self.logprob_versions
        own = self.logprob_versions or [self.weight_version] * len(self.kv_versions)
        return [min(a, b) for a, b in zip(own, self.kv_versions)]


def compact_versions(own: list[int], cache: list[int], default: int) -> tuple[int, list[int] | None, list[int] | None]:
    """A rollout's ``weight_version`` (its oldest, ``default`` without tokens) and its
    ``logprob_versions`` and ``kv_versions`` from the per-token ones: None when all are that one."""
    oldest = min(min(own, default=default), min(cache, default=default))
    uniform = all(v == oldest for v in own) and all(v == oldest for v in cache)
    return oldest, None if uniform else own, None if uniform else cache


# Streaming: called from the engine for every generated token, in order per sample:
# (prompt_index, sample_index, token_id, logprob, top (id, logprob) pairs or None, finish_reason or None)
TokenCallback = Callable[[int, int, int, float, "list[tuple[int, float]] | None", "str | None"], None]


Score = tuple["float | None", "str | None"]  # a scorer's (value, error) for one sample


@dataclass
class ScoreRequest:
    """One (prompt, response) to score, with the dataset row's other columns."""

    prompt: str
    response: str
    columns: dict[str, Any]
    response_tokens: int = 0

    @staticmethod
    def of(prompt: str | Prompt, response: str, columns: dict[str, Any]) -> ScoreRequest:
        """The request for ``RewardService.score``: a :class:`Prompt` brings its text and its columns
        (its ``task_type`` picks the components that apply), ``columns`` adding to them."""
        if isinstance(prompt, Prompt):
            return ScoreRequest(prompt.text, response, {**prompt.columns, **columns})
        return ScoreRequest(prompt, response, columns)


@dataclass
class RewardResult:
    """The score of one (prompt, response). ``reward`` is None when the sample is unscorable."""

    reward: float | None
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    reasons: dict[str, str] = field(default_factory=dict)  # per component, why it scored what it did
    flags: list[str] = field(default_factory=list)  # kept but suspicious, e.g. a value outside its expected range

    @property
    def unscorable(self) -> bool:
        return self.reward is None

    def __float__(self) -> float:
        """The reward as a number (``float(service.score(prompt, response))``, the seed's form); an
        unscorable sample's raises, naming why."""
        if self.reward is None:
            raise ValueError(f"the sample could not be scored: {self.error or 'no score'}")
        return self.reward


@dataclass
class Experience:
    """One sample as the Experience Buffer stores it: the per-sample view of a step.

    ``advantage`` is one number (broadcast over the response) or one per response token; None is
    an error when a batch is built, never a silent 0. ``group_id`` names the prompt the sample
    answers (unique within a step): the trainer keeps and packs a group's samples together.
    ``loss_mask`` (per response token, default all 1) excludes tokens from the loss while keeping
    them in the context (tool output in a multi-turn rollout). ``logprob_versions`` (per response
    token, default all ``weight_version``) says which weights produced each behaviour logprob.
    ``values`` are the critic's, per response token, at rollout time, and ``returns`` its targets
    (PPO with GAE).
    ``metadata``: ``task_type``, ``source``, ``engine``, ``finish_reason``, ``batch`` (the producer
    batch it came in, from 1) and ``row`` (its place in it), ``generated_at`` and
    ``scored_at`` (Unix seconds), the reward's ``components``, ``reasons`` and ``error``.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float | None  # None: the sample was unscorable (it trains with no weight)
    advantage: float | list[float] | None
    weight_version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    group_id: int | None = None
    loss_mask: list[int] | None = None
    logprob_versions: list[int] | None = None
    values: list[float] | None = None
    returns: list[float] | None = None


OPTIONAL_PER_TOKEN = ("values", "returns")  # per-token floats only some algorithms have (the critic's)


@dataclass(frozen=True)
class PreferencePair:
    """A prompt with a preferred and a rejected completion (``postrl dpo``), as token ids."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str


@dataclass(frozen=True)
class Health:
    """A health check's answer; falsy when the engine cannot serve, with the reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class BufferBatch:
    """What one ``get`` hands out: the experiences (group ids renumbered to be unique across the
    puts they came from) and their lags; how many stale ones were dropped on the way."""

    experiences: list[Experience]
    lags: list[int]
    dropped: int

    def metrics(self) -> dict[str, float]:
        return {
            BUFFER_LAG_MEAN: sum(self.lags) / len(self.lags) if self.lags else 0.0,
            BUFFER_LAG_MAX: float(max(self.lags, default=0)),
            BUFFER_DROPPED: float(self.dropped),
        }
