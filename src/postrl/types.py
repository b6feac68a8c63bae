"""The data that moves through one RL step, as typed records (no string-keyed bags of tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch


@dataclass
class Prompt:
    """One prompt, tokenized, with the dataset row's other columns for the reward function."""

    text: str
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # "file:line", for error messages


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


FinishReason = Literal["stop", "length"]


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


# Streaming: called from the engine for every generated token, in order per sample:
# (prompt_index, sample_index, token_id, logprob, top (id, logprob) pairs or None, finish_reason or None)
TokenCallback = Callable[[int, int, int, float, "list[tuple[int, float]] | None", "str | None"], None]


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


@dataclass
class Experience:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    advantage: float | None
    weight_version: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExperienceBatch:
    """Right-padded ``[B, T]`` tensors of prompt+response; masks select response tokens.

    ``response_mask[b, t]`` is 1 where token ``t+1`` ... is a response token whose logprob is
    predicted at position ``t`` (i.e. masks are aligned with the shifted targets, length T-1).
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    response_mask: torch.Tensor  # [B, T-1] float, aligned with targets input_ids[:, 1:]
    old_logprobs: torch.Tensor  # [B, T-1] float, 0 outside the response
    advantages: torch.Tensor  # [B] float
    weight_versions: torch.Tensor  # [B] long

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def select(self, index: torch.Tensor | slice) -> ExperienceBatch:
        return ExperienceBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            response_mask=self.response_mask[index],
            old_logprobs=self.old_logprobs[index],
            advantages=self.advantages[index],
            weight_versions=self.weight_versions[index],
        )

    @staticmethod
    def from_experiences(experiences: list[Experience], pad_id: int) -> ExperienceBatch:
        if not experiences:
            raise ValueError("cannot build an ExperienceBatch from zero experiences")
        width = max(len(e.prompt_ids) + len(e.response_ids) for e in experiences)
        n = len(experiences)
        input_ids = torch.full((n, width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        response_mask = torch.zeros((n, width - 1), dtype=torch.float32)
        old_logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
        for row, e in enumerate(experiences):
            if len(e.logprobs) != len(e.response_ids):
                raise ValueError(
                    f"experience {row}: {len(e.logprobs)} logprobs for {len(e.response_ids)} response tokens"
                )
            p, r = len(e.prompt_ids), len(e.response_ids)
            input_ids[row, : p + r] = torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long)
            attention_mask[row, : p + r] = 1
            if r:
                response_mask[row, p - 1 : p - 1 + r] = 1.0
                old_logprobs[row, p - 1 : p - 1 + r] = torch.tensor(e.logprobs, dtype=torch.float32)
        advantages = torch.tensor([e.advantage or 0.0 for e in experiences], dtype=torch.float32)
        versions = torch.tensor([e.weight_version for e in experiences], dtype=torch.long)
        return ExperienceBatch(input_ids, attention_mask, response_mask, old_logprobs, advantages, versions)


@dataclass
class TrainMetrics:
    mismatch_kl: float  # KL(pi_rollout || pi_trainer) on the rollout's tokens, before any update
    logprob_diff_max: float
    loss: float
    kl: float
    entropy: float
    clip_fraction: float
    grad_norm: float
    learning_rate: float
    optimizer_steps: int
    skipped_steps: int


@dataclass
class StepMetrics:
    step: int
    weight_version: int
    values: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)  # text for the console, e.g. the top unscorable reason
