"""What a step reports: its metrics, notes for the console, the samples file, stage timings."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from postrl.config.distill import DistillConfig
from postrl.types import Prompt, RewardResult, Rollout, StepBatch
from postrl.types.episode import Episode
from postrl.types.metric_names import (
    BUFFER_SIZE,
    RESPONSE_CLIP_RATIO,
    RESPONSE_LENGTH_MAX,
    RESPONSE_LENGTH_MEAN,
    REWARD_FLAGGED,
    REWARD_MAX,
    REWARD_MEAN,
    REWARD_MIN,
    REWARD_NO_SIGNAL_GROUPS,
    REWARD_SERVICE_ERRORS,
    REWARD_STD,
    REWARD_UNSCORABLE,
    ROLLOUT_ENGINE_HEALTHY,
    ROLLOUT_ENGINE_RESTARTS,
    ROLLOUT_ENGINES,
    SYNC_BYTES,
    SYNC_FAILURES,
    component_mean,
)

T = TypeVar("T")


class StageTimer:
    """Seconds per stage of a step, and the step's total."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def run(self, stage: str, fn: Callable[..., T], *args: object) -> T:
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - began

    def total(self) -> dict[str, float]:
        return {**self.seconds, "step": time.perf_counter() - self.start}


def most_common_error(rewards: list[RewardResult]) -> str | None:
    """The most frequent unscorable reason of a step, with its count."""
    errors = Counter(res.error or "no score" for res in rewards if res.unscorable)
    if not errors:
        return None
    error, count = errors.most_common(1)[0]
    return f"{count}x {error}"


def no_signal_fraction(rollouts: list[Rollout], rewards: list[RewardResult]) -> float:
    """The share of prompt groups whose scored rewards are all equal: a group baseline gives each of
    their samples advantage 0, so they teach nothing."""
    groups: dict[int, set[float]] = {}
    for r, res in zip(rollouts, rewards):
        seen = groups.setdefault(r.prompt_index, set())
        if res.reward is not None:
            seen.add(res.reward)
    return sum(len(v) <= 1 for v in groups.values()) / len(groups) if groups else 0.0


def write_samples(
    path: Path,
    prompts: list[Prompt],
    rollouts: list[Rollout],
    rewards: list[RewardResult],
    step: StepBatch | None = None,
) -> Path:
    """One JSON line per sample: what the model wrote, what each reward component made of it and,
    once advantages are computed (``step``), its advantage and metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, (r, res) in enumerate(zip(rollouts, rewards)):
            prompt = prompts[r.prompt_index]
            row = {
                "prompt": prompt.text if r.episode is None else first_observation(r.episode, prompt.text),
                "response": r.text,
                "reward": res.reward,
                "components": res.components,
                "reasons": res.reasons,
                "error": res.error,
                "unscorable": res.unscorable,
                "flags": res.flags,
                "advantage": None if step is None else step.advantage_of(i),
                "finish_reason": r.finish_reason,
                "response_tokens": len(r.response_ids),
                "prompt_index": r.prompt_index,
                "source": prompt.source,
                "metadata": None if step is None else _plain_metadata(step, i),
                "episode": None if r.episode is None else _episode_row(r.episode),
            }
            f.write(json.dumps(row, allow_nan=True, default=repr) + "\n")  # an env's info may hold anything
    return path


def first_observation(episode: Episode, row_prompt: str) -> str:
    """What the model was first shown in ``episode``: its first user message (an environment's
    first observation, an agent function's first request), else the dataset row's prompt."""
    for message in episode.messages:
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):  # content parts: their text
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return str(content or "")
    return row_prompt


def _episode_row(episode: Episode) -> dict[str, Any]:
    """What the samples file shows of a rollout's episode: how it ended, where its time went, its
    failure (the traceback is in episode_errors.log) and its messages, as the model saw them."""
    info = {k: v for k, v in episode.info.items() if k != "env_traceback"}
    return {
        "finish_reason": episode.finish_reason,
        "turns": len(episode.turns),
        "tool_calls": episode.tool_calls,
        "tool_errors": episode.tool_errors,
        "env_s": round(episode.env_s, 3),
        "generate_s": round(episode.generate_s, 3),
        "part": episode.part,
        **({"seat": episode.seat} if episode.seat is not None else {}),
        "info": info,
        "messages": episode.messages,
    }


def _plain_metadata(step: StepBatch, row: int) -> dict:
    """The sample's metadata without what the row already shows (the reward's parts)."""
    skip = {"components", "reasons", "error", "source", "finish_reason"}
    return {k: v for k, v in step.metadata(row).items() if k not in skip}


def step_notes(rewards: list[RewardResult], no_signal: float, distill: DistillConfig | None = None) -> dict[str, str]:
    """Text for the console: the top unscorable reason, groups without signal, flagged samples.
    With ``distill``, a group of identical rewards still learns from its teacher: said so where
    the task reward is part of the advantage, not said where it is not."""
    notes = {}
    reason = most_common_error(rewards)
    if reason:
        notes["unscorable_reason"] = reason
    if no_signal > 0 and distill is None:
        notes["no_signal"] = f"{no_signal:.0%} of groups have identical rewards (no advantage, no gradient)"
    elif no_signal > 0 and distill is not None and distill.task_reward:
        notes["no_signal"] = (
            f"{no_signal:.0%} of groups have identical rewards (their gradient is the teacher's term alone)"
        )
    flags = Counter(f for r in rewards for f in r.flags)
    if flags:
        flag, count = flags.most_common(1)[0]
        notes["flagged"] = f"{sum(bool(r.flags) for r in rewards)} samples flagged, e.g. {count}x {flag}"
    return notes


def reward_values(rollouts: list[Rollout], rewards: list[RewardResult]) -> dict[str, float]:
    scored = torch.tensor([r.reward for r in rewards if r.reward is not None], dtype=torch.float64)
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float64)
    nan = float("nan")
    values = {
        REWARD_MEAN: float(scored.mean()) if scored.numel() else nan,
        REWARD_STD: float(scored.std(unbiased=False)) if scored.numel() else nan,
        REWARD_MIN: float(scored.min()) if scored.numel() else nan,
        REWARD_MAX: float(scored.max()) if scored.numel() else nan,
        REWARD_UNSCORABLE: float(sum(r.unscorable for r in rewards)),
        REWARD_FLAGGED: float(sum(bool(r.flags) for r in rewards)),
        REWARD_NO_SIGNAL_GROUPS: no_signal_fraction(rollouts, rewards),
        RESPONSE_LENGTH_MEAN: float(lengths.mean()),
        RESPONSE_LENGTH_MAX: float(lengths.max()),
        RESPONSE_CLIP_RATIO: sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
    }
    for name in sorted({k for r in rewards for k in r.components}):
        vals = [r.components[name] for r in rewards if name in r.components]
        values[component_mean(name)] = sum(vals) / len(vals)
    return values


def operating_figures(pool: Any, reward: Any, buffer: Any, engine_healthy: bool, sync_bytes: int) -> dict[str, float]:
    """What an operator watches besides learning: the engines, their restarts and the ones lost in
    syncs, what they counted in the step (prefill and decode seconds), the last sync's bytes, the
    reward service's errors, the buffer's size."""
    return {
        **pool.counters(),
        ROLLOUT_ENGINES: float(len(pool.engines)),
        ROLLOUT_ENGINE_HEALTHY: float(engine_healthy),
        ROLLOUT_ENGINE_RESTARTS: float(pool.restarts),
        SYNC_BYTES: float(sync_bytes),
        SYNC_FAILURES: float(pool.sync_failures),
        REWARD_SERVICE_ERRORS: float(reward.error_count()),
        BUFFER_SIZE: float(len(buffer)),
    }
