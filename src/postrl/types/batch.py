"""A step's data in the training layout: padded once (:func:`pad_sequences`) into ``[B, T-1]`` tensors."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from postrl.types.records import OPTIONAL_PER_TOKEN, Experience, Prompt, RewardResult, Rollout


@dataclass(frozen=True)
class Padded:
    """Right-padded ``[B, T]`` ids and attention mask of ``prompt + completion`` rows, the
    ``[B, T-1]`` completion mask aligned with the shifted targets, each row's completion span in
    that layout, and the (rows, columns) index of every completion position, row by row, so that
    per-token values of all rows are placed with one assignment."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    spans: list[slice]
    response_index: tuple[torch.Tensor, torch.Tensor]

    def per_token(self, values: list[float] | list[int], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        """A ``[B, T-1]`` tensor holding ``values`` (every row's completion values, concatenated)
        at the completion positions and ``fill`` elsewhere."""
        out = torch.full(self.response_mask.shape, fill, dtype=dtype)
        out[self.response_index] = torch.tensor(values, dtype=dtype)
        return out


def pad_sequences(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Padded:
    """The one place a step's data is padded (:class:`Padded`)."""
    if not rows:
        raise ValueError("cannot pad zero rows")
    width = max(len(p) + len(c) for p, c in rows)
    tokens: list[int] = []
    seq_rows: list[int] = []
    seq_cols: list[int] = []
    resp_rows: list[int] = []
    resp_cols: list[int] = []
    spans = []
    for i, (prompt, response) in enumerate(rows):
        p, n = len(prompt), len(response)
        tokens += prompt
        tokens += response
        seq_rows += [i] * (p + n)
        seq_cols += range(p + n)
        spans.append(slice(p - 1, p - 1 + n))
        resp_rows += [i] * n
        resp_cols += range(p - 1, p - 1 + n)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    seq_index = (torch.tensor(seq_rows, dtype=torch.long), torch.tensor(seq_cols, dtype=torch.long))
    ids[seq_index] = torch.tensor(tokens, dtype=torch.long)
    attention[seq_index] = 1
    response_index = (torch.tensor(resp_rows, dtype=torch.long), torch.tensor(resp_cols, dtype=torch.long))
    completion = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    completion[response_index] = 1.0
    return Padded(ids, attention, completion, spans, response_index)


@dataclass
class ExperienceBatch:
    """Right-padded ``[B, T]`` tensors of prompt+response, with ``[B, T-1]`` tensors aligned with the
    shifted targets ``input_ids[:, 1:]``: position ``t`` holds what belongs to token ``t+1``.

    ``response_mask`` marks response tokens (their logprobs are recomputed); ``loss_mask`` the
    subset that is trained on. ``old_logprobs`` are the behaviour logprobs and
    ``logprob_versions`` the weight version that produced each of them; ``values`` and ``returns``
    the critic's values at rollout time and its targets.
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
    values: torch.Tensor | None = None  # [B, T-1] float, the critic's at rollout time (PPO with GAE)
    returns: torch.Tensor | None = None  # [B, T-1] float, the critic's targets
    proximal_logprobs: torch.Tensor | None = None  # [B, T-1] the trainer's before the update (old_logprobs: recompute)
    token_lags: torch.Tensor | None = None  # [B, T-1] long, versions behind the trainer's weights (with_lags)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def with_lags(self, trainer_version: int) -> ExperienceBatch:
        """The batch with ``token_lags``: how many versions each response token's weights are
        behind ``trainer_version``, the weights the update starts from (-1 outside the response)."""
        lags = torch.where(self.logprob_versions >= 0, trainer_version - self.logprob_versions, -1)
        return replace(self, token_lags=lags)

    def without_lagging_tokens(self, max_lag: int) -> tuple[ExperienceBatch, float]:
        """``algorithm.max_token_lag``: response tokens whose weights lag the trainer's by more than
        ``max_lag`` versions (:attr:`token_lags`) leave the loss (they stay in the context); the
        batch and how many tokens were masked."""
        if self.token_lags is None:
            raise ValueError("without_lagging_tokens needs the batch's token_lags (ExperienceBatch.with_lags)")
        keep = (self.token_lags <= max_lag).to(self.loss_mask.dtype)
        masked = float((self.loss_mask * (1 - keep)).sum().item())
        return replace(self, loss_mask=self.loss_mask * keep), masked

    @property
    def num_tokens(self) -> int:
        """Tokens the loss is computed over."""
        return int(self.loss_mask.sum().item())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ExperienceBatch:
        return ExperienceBatch(**{f.name: _maybe(fn, getattr(self, f.name)) for f in fields(self)})  # type: ignore[arg-type]

    def select(self, index: torch.Tensor | slice) -> ExperienceBatch:
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> ExperienceBatch:
        return self._map(lambda t: t.to(device))

    def split(self, mini_batch_size: int) -> list[ExperienceBatch]:
        """Consecutive batches of ``mini_batch_size`` rows (the last may be smaller)."""
        if mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
        return [self.select(slice(s, s + mini_batch_size)) for s in range(0, self.size, mini_batch_size)]

    def trimmed(self) -> ExperienceBatch:
        """The same rows without the padding columns no row uses (e.g. a slice of a wider batch)."""
        width = int(self.attention_mask.sum(dim=1).max().item()) if self.size else 0
        if width >= self.input_ids.shape[1]:
            return self
        full = {"input_ids", "attention_mask"}  # [B, T]; the other 2-d fields are [B, T-1]
        trimmed = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value.dim() == 2:
                value = value[:, : width if f.name in full else width - 1]
            trimmed[f.name] = value
        return ExperienceBatch(**trimmed)

    @staticmethod
    def from_experiences(experiences: list[Experience], pad_id: int) -> ExperienceBatch:
        """Collate a batch from the buffer's experiences."""
        if not experiences:
            raise ValueError("cannot build an ExperienceBatch from zero experiences")
        padded = pad_sequences([(e.prompt_ids, e.response_ids) for e in experiences], pad_id)
        names = ["loss_mask", "old_logprobs", "advantages"]
        names += [name for name in OPTIONAL_PER_TOKEN if any(getattr(e, name) is not None for e in experiences)]
        flat: dict[str, list] = {name: [] for name in [*names, "logprob_versions"]}
        for row, e in enumerate(experiences):
            given = _response_values(row, e)
            for name in flat:
                flat[name] += given[name]
        per_token = {name: padded.per_token(flat[name], torch.float32) for name in names}
        return ExperienceBatch(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            response_mask=padded.response_mask,
            **per_token,
            group_ids=group_ids_of(experiences),
            weight_versions=torch.tensor([e.weight_version for e in experiences], dtype=torch.long),
            logprob_versions=padded.per_token(flat["logprob_versions"], torch.long, fill=-1),
        )


def _maybe(fn: Callable[[torch.Tensor], torch.Tensor], value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else fn(value)


def group_ids_of(experiences: list[Experience]) -> torch.Tensor:
    """Each experience's group; those without one are each a group of their own (new ids)."""
    given = [e.group_id for e in experiences if e.group_id is not None]
    next_free = max(given, default=-1) + 1
    ids = []
    for e in experiences:
        if e.group_id is None:
            ids.append(next_free)
            next_free += 1
        else:
            ids.append(e.group_id)
    return torch.tensor(ids, dtype=torch.long)


def _response_values(row: int, e: Experience) -> dict[str, list]:
    """The per-response-token values of one experience, checked against its response length."""
    r = len(e.response_ids)
    if e.advantage is None:
        raise ValueError(f"experience {row} has no advantage: compute advantages before building a batch")
    advantages = [float(e.advantage)] * r if isinstance(e.advantage, (int, float)) else list(e.advantage)
    values: dict[str, list[Any]] = {
        "old_logprobs": list(e.logprobs),
        "advantages": advantages,
        "loss_mask": [1] * r if e.loss_mask is None else list(e.loss_mask),
        "logprob_versions": [e.weight_version] * r if e.logprob_versions is None else list(e.logprob_versions),
    }
    for name in OPTIONAL_PER_TOKEN:
        given = getattr(e, name)
        values[name] = [0.0] * r if given is None else list(given)
    names = {
        "old_logprobs": "logprobs",
        "advantages": "advantages",
        "loss_mask": "loss_mask entries",
        "logprob_versions": "logprob_versions",
        "values": "values",
        "returns": "returns",
    }
    for key, got in values.items():
        if len(got) != r:
            raise ValueError(f"experience {row}: {len(got)} {names[key]} for {r} response tokens")
    if any(m not in (0, 1) for m in values["loss_mask"]):
        raise ValueError(f"experience {row}: loss_mask entries must be 0 or 1")
    return values


@dataclass
class StepBatch:
    """One step's data after scoring, in the training layout, built once (:meth:`build`).

    ``batch`` holds the ``[B, T-1]`` token tensors the trainer reads (an unscorable sample's loss
    mask is all 0: it stays in its group's context but weighs nothing); ``rewards`` (NaN:
    unscorable) and ``unscorable`` are per sample. The stages add what they compute:
    ``batch.values`` (the critic), ``ref_logprobs`` and ``kl_penalty`` (``[B, T-1]`` reference
    logprobs and -beta x KL, KL in the reward),
    ``baseline`` (``[B]``, the greedy response's reward of each sample's prompt),
    ``teacher_logprobs`` and ``distill`` (``[B, T-1]``, on-policy distillation's teacher logprobs
    and per-token term, ``taught`` the rows a teacher scored) and, last, the advantages
    (``batch.advantages``). ``prompts``, ``rollouts`` and ``results`` are the records
    the batch was built from, for metrics and the samples file.
    """

    prompts: list[Prompt]
    rollouts: list[Rollout]
    results: list[RewardResult]
    batch: ExperienceBatch
    rewards: torch.Tensor  # [B] float32, NaN: unscorable
    unscorable: torch.Tensor  # [B] bool
    spans: list[slice]  # each row's response positions in the [B, T-1] layout
    model_mask: torch.Tensor  # [B, T-1] 1 on the tokens the model generated (not a tool's output)
    times: dict[str, float] = field(default_factory=dict)  # batch; generated_at, scored_at (Unix seconds)
    ref_logprobs: torch.Tensor | None = None
    kl_penalty: torch.Tensor | None = None
    baseline: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    distill: torch.Tensor | None = None
    taught: torch.Tensor | None = None  # [B] bool
    token_level: bool = False  # the advantages are per token (else one per sample, broadcast)

    @staticmethod
    def build(
        prompts: list[Prompt], rollouts: list[Rollout], results: list[RewardResult], pad_id: int, **times: float
    ) -> StepBatch:
        padded = pad_sequences([(r.prompt_ids, r.response_ids) for r in rollouts], pad_id)
        unscorable = torch.tensor([res.unscorable for res in results], dtype=torch.bool)
        logprobs: list[float] = []
        versions: list[int] = []
        generated: list[int] = []
        for row, r in enumerate(rollouts):
            if len(r.logprobs) != len(r.response_ids):
                raise ValueError(f"rollout {row}: {len(r.logprobs)} logprobs for {len(r.response_ids)} response tokens")
            if r.loss_mask is not None and len(r.loss_mask) != len(r.response_ids):
                raise ValueError(
                    f"rollout {row}: {len(r.loss_mask)} loss_mask entries for {len(r.response_ids)} tokens"
                )
            logprobs += r.logprobs
            versions += r.token_versions() or [r.weight_version] * len(r.response_ids)
            generated += r.loss_mask or [1] * len(r.response_ids)
        response_mask = padded.response_mask
        model_mask = padded.per_token(generated, torch.float32)
        batch = ExperienceBatch(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            response_mask=response_mask,
            loss_mask=model_mask * (~unscorable).unsqueeze(1).float(),
            old_logprobs=padded.per_token(logprobs, torch.float32),
            advantages=torch.zeros_like(response_mask),
            group_ids=torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long),
            weight_versions=torch.tensor([r.weight_version for r in rollouts], dtype=torch.long),
            logprob_versions=padded.per_token(versions, torch.long, fill=-1),
        )
        rewards = torch.tensor([math.nan if res.reward is None else res.reward for res in results], dtype=torch.float32)
        return StepBatch(prompts, rollouts, results, batch, rewards, unscorable, padded.spans, model_mask, dict(times))

    @property
    def size(self) -> int:
        return self.batch.size

    def mark_unscorable(self, row: int, error: str) -> None:
        """Row ``row`` could not be scored after all (e.g. its teacher failed): as a reward failure,
        it stays in its group's context and weighs nothing."""
        self.results[row] = RewardResult(None, dict(self.results[row].components), error)
        self.rewards[row] = math.nan
        self.unscorable[row] = True
        self.batch.loss_mask[row] = 0.0

    def set_advantages(self, advantages: torch.Tensor) -> None:
        """An estimator's ``[B]`` (broadcast over each response) or ``[B, T-1]`` advantages."""
        self.token_level = advantages.dim() == 2
        per_token = advantages if self.token_level else advantages.unsqueeze(1).expand_as(self.batch.response_mask)
        on = self.batch.response_mask > 0
        self.batch.advantages = torch.where(on, per_token.to(torch.float32), torch.zeros_like(self.batch.advantages))

    def advantage_of(self, row: int) -> float | list[float]:
        """Row ``row``'s advantage: one number, or one per response token."""
        per_token = self.batch.advantages[row, self.spans[row]]
        if not self.token_level:
            return float(per_token[0]) if per_token.numel() else 0.0
        return per_token.tolist()

    def experiences(self) -> list[Experience]:
        """The per-sample views the Experience Buffer stores."""
        out = []
        for row, (r, res, span) in enumerate(zip(self.rollouts, self.results, self.spans)):
            out.append(
                Experience(
                    prompt_ids=r.prompt_ids,
                    response_ids=r.response_ids,
                    logprobs=r.logprobs,
                    reward=res.reward,
                    advantage=self.batch.advantages[row, span].tolist(),
                    weight_version=r.weight_version,
                    metadata=self.metadata(row),
                    group_id=r.prompt_index,
                    logprob_versions=r.token_versions(),
                    loss_mask=[0] * len(r.response_ids) if res.unscorable else r.loss_mask,
                    values=None if self.batch.values is None else self.batch.values[row, span].tolist(),
                    returns=None if self.batch.returns is None else self.batch.returns[row, span].tolist(),
                )
            )
        return out

    def metadata(self, row: int) -> dict[str, Any]:
        r, res = self.rollouts[row], self.results[row]
        prompt = self.prompts[r.prompt_index]
        return {
            "task_type": prompt.task_type,
            "source": prompt.source,
            "engine": r.engine,
            "finish_reason": r.finish_reason,
            **self.times,
            "row": row,
            "components": res.components,
            "reasons": res.reasons,
            "error": res.error,
        }
