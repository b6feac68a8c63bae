"""The data that moves through one RL step, as typed records (no string-keyed bags of tensors)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

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
    # the weight version behind each token's logprob; None: all ``weight_version`` (an engine that
    # takes new weights in the middle of a response fills it in)
    logprob_versions: list[int] | None = None


# Streaming: called from the engine for every generated token, in order per sample:
# (prompt_index, sample_index, token_id, logprob, top (id, logprob) pairs or None, finish_reason or None)
TokenCallback = Callable[[int, int, int, float, "list[tuple[int, float]] | None", "str | None"], None]


Score = tuple["float | None", "str | None"]  # a scorer's (value, error) for one sample


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
    """One sample as the trainer sees it.

    ``advantage`` is one number (broadcast over the response) or one per response token; None is
    an error when a batch is built, never a silent 0. ``group_id`` names the prompt the sample
    answers (unique within a step): the trainer keeps and packs a group's samples together.
    ``loss_mask`` (per response token, default all 1) excludes tokens from the loss while keeping
    them in the context (tool output in a multi-turn rollout). ``logprob_versions`` (per response
    token, default all ``weight_version``) says which weights produced each behaviour logprob.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    advantage: float | list[float] | None
    weight_version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    group_id: int | None = None
    loss_mask: list[int] | None = None
    logprob_versions: list[int] | None = None


@dataclass
class ExperienceBatch:
    """Right-padded ``[B, T]`` tensors of prompt+response, with ``[B, T-1]`` tensors aligned with the
    shifted targets ``input_ids[:, 1:]``: position ``t`` holds what belongs to token ``t+1``.

    ``response_mask`` marks response tokens (their logprobs are recomputed); ``loss_mask`` the
    subset that is trained on. ``old_logprobs`` are the behaviour logprobs and
    ``logprob_versions`` the weight version that produced each of them.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    response_mask: torch.Tensor  # [B, T-1] float
    loss_mask: torch.Tensor  # [B, T-1] float, <= response_mask
    old_logprobs: torch.Tensor  # [B, T-1] float, 0 outside the response
    advantages: torch.Tensor  # [B, T-1] float, 0 outside the response
    group_ids: torch.Tensor  # [B] long
    weight_versions: torch.Tensor  # [B] long, the version the sample was generated under
    logprob_versions: torch.Tensor  # [B, T-1] long, -1 outside the response

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens the loss is computed over."""
        return int(self.loss_mask.sum().item())

    def select(self, index: torch.Tensor | slice) -> ExperienceBatch:
        return ExperienceBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device: torch.device | str) -> ExperienceBatch:
        return ExperienceBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @staticmethod
    def from_experiences(experiences: list[Experience], pad_id: int) -> ExperienceBatch:
        if not experiences:
            raise ValueError("cannot build an ExperienceBatch from zero experiences")
        width = max(len(e.prompt_ids) + len(e.response_ids) for e in experiences)
        n = len(experiences)
        input_ids = torch.full((n, width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        per_token = {
            name: torch.zeros((n, width - 1), dtype=torch.float32)
            for name in ("response_mask", "loss_mask", "old_logprobs", "advantages")
        }
        logprob_versions = torch.full((n, width - 1), -1, dtype=torch.long)
        given = [e.group_id for e in experiences if e.group_id is not None]
        next_free = max(given, default=-1) + 1  # samples without a group are each a group of one
        group_ids = []
        for row, e in enumerate(experiences):
            values = _response_values(row, e)
            p, r = len(e.prompt_ids), len(e.response_ids)
            input_ids[row, : p + r] = torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long)
            attention_mask[row, : p + r] = 1
            if r:
                span = slice(p - 1, p - 1 + r)
                per_token["response_mask"][row, span] = 1.0
                for name in ("loss_mask", "old_logprobs", "advantages"):
                    per_token[name][row, span] = torch.tensor(values[name], dtype=torch.float32)
                logprob_versions[row, span] = torch.tensor(values["logprob_versions"], dtype=torch.long)
            if e.group_id is None:
                group_ids.append(next_free)
                next_free += 1
            else:
                group_ids.append(e.group_id)
        return ExperienceBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **per_token,
            group_ids=torch.tensor(group_ids, dtype=torch.long),
            weight_versions=torch.tensor([e.weight_version for e in experiences], dtype=torch.long),
            logprob_versions=logprob_versions,
        )


def _response_values(row: int, e: Experience) -> dict[str, list]:
    """The per-response-token values of one experience, checked against its response length."""
    r = len(e.response_ids)
    if e.advantage is None:
        raise ValueError(f"experience {row} has no advantage: compute advantages before building a batch")
    advantages = [float(e.advantage)] * r if isinstance(e.advantage, (int, float)) else list(e.advantage)
    values = {
        "old_logprobs": list(e.logprobs),
        "advantages": advantages,
        "loss_mask": [1] * r if e.loss_mask is None else list(e.loss_mask),
        "logprob_versions": [e.weight_version] * r if e.logprob_versions is None else list(e.logprob_versions),
    }
    names = {
        "old_logprobs": "logprobs",
        "advantages": "advantages",
        "loss_mask": "loss_mask entries",
        "logprob_versions": "logprob_versions",
    }
    for key, got in values.items():
        if len(got) != r:
            raise ValueError(f"experience {row}: {len(got)} {names[key]} for {r} response tokens")
    if any(m not in (0, 1) for m in values["loss_mask"]):
        raise ValueError(f"experience {row}: loss_mask entries must be 0 or 1")
    return values


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
    clip_low_fraction: float = 0.0
    clip_high_fraction: float = 0.0
    dual_clip_fraction: float = 0.0
    approx_kl: float = 0.0  # KL(pi_old || pi) over the trained tokens, k3


@dataclass
class StepMetrics:
    step: int
    weight_version: int
    values: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)  # text for the console, e.g. the top unscorable reason
