"""The Controller: one RL step as data flowing forward once.

sample_prompts -> RolloutWorker.generate -> RewardService.score_batch -> compute_advantage ->
ExperienceBuffer.put/get -> TrainWorker.update -> sync_weights -> metrics.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from postrl.algorithms import ADVANTAGES
from postrl.buffer import OnPolicyBuffer
from postrl.config.run import RunConfig
from postrl.controller.advantage_inputs import advantage_inputs, per_sample
from postrl.controller.stages import AlgorithmStages
from postrl.data import PromptDataset, PromptSampler
from postrl.models.weights import dedupe_tied, weight_manifest, write_sync_file
from postrl.reward import RewardService, ScoreRequest
from postrl.reward.client import RemoteRewardService, RewardServiceError
from postrl.rollout import RolloutWorker
from postrl.rollout.common import EngineUnhealthyError
from postrl.train.group import TrainGroup
from postrl.train.worker import TrainWorker
from postrl.types import (
    Experience,
    ExperienceBatch,
    Prompt,
    RewardResult,
    Rollout,
    SamplingParams,
    StepMetrics,
    TrainMetrics,
)

T = TypeVar("T")


class RewardFailureError(RuntimeError):
    """Too many samples of a step could not be scored (reward.max_failure_rate)."""


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
    advantages: list[float | list[float]] | None = None,
) -> Path:
    """One JSON line per sample: what the model wrote, and what each reward component made of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, (r, res) in enumerate(zip(rollouts, rewards)):
            prompt = prompts[r.prompt_index]
            row = {
                "prompt": prompt.text,
                "response": r.text,
                "reward": res.reward,
                "components": res.components,
                "reasons": res.reasons,
                "error": res.error,
                "unscorable": res.unscorable,
                "flags": res.flags,
                "advantage": None if advantages is None else advantages[i],
                "finish_reason": r.finish_reason,
                "response_tokens": len(r.response_ids),
                "prompt_index": r.prompt_index,
                "source": prompt.source,
            }
            f.write(json.dumps(row, allow_nan=True) + "\n")
    return path


class StageTimer:
    """Seconds per stage of a step, and the step's total."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def run(self, stage: str, fn: Callable[..., T], *args: Any) -> T:
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[stage] = time.perf_counter() - began

    def total(self) -> dict[str, float]:
        return {**self.seconds, "step": time.perf_counter() - self.start}


@dataclass
class Components:
    """Everything a Controller drives; built by :func:`postrl.run.train_runner.build_components`."""

    config: RunConfig
    tokenizer: Any
    dataset: PromptDataset
    rollout: RolloutWorker
    reward: RewardService | RemoteRewardService
    trainer: TrainWorker | TrainGroup
    buffer: OnPolicyBuffer
    scheduler: Any = None  # LocalScheduler | RayScheduler: placed the workers; closed last
    critic: Any = None  # CriticWorker (or its actor) when algorithm.critic is set (PPO with GAE)


class Controller(AlgorithmStages):
    def __init__(self, parts: Components, sync_dir: Any = None) -> None:
        self.parts = parts
        self.config = parts.config
        self.sampler = PromptSampler(len(parts.dataset), seed=self.config.seed, shuffle=self.config.data.shuffle)
        self.step_count = 0
        self.weight_version = 0
        self.sync_dir = sync_dir
        r = self.config.rollout
        self.sampling = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_tokens,
            stop=tuple(r.stop),
            stop_token_ids=tuple(r.stop_token_ids),
        )
        self._greedy_baseline = ADVANTAGES.needs_baseline(self.config.algorithm.advantage.type)
        self.kl_beta = self.config.algorithm.kl_beta
        self.step_stats: dict[str, float] = {}  # per step: dynamic sampling's rounds, the critic's loss
        self._pre_step_state: dict[str, Any] | None = None
        self._updating = False
        self.sync_weights(bump=False)

    # -- the step ----------------------------------------------------------------------------
    def sample_prompts(self) -> list[Prompt]:
        return [self.parts.dataset[i] for i in self.sampler.next_indices(self.config.prompts_per_step)]

    def step(self) -> StepMetrics:
        """One RL step, a line per stage; the timer records each stage's seconds."""
        self.apply_rollout_schedule()
        self.step_stats = {}
        timer = StageTimer()
        self._pre_step_state, self._updating = self.state_dict(), False
        prompts = self.sample_prompts()
        rollouts = timer.run("generate", self.generate, prompts)
        rewards = timer.run("reward", self.score, prompts, rollouts)
        if self.config.algorithm.dynamic_sampling:
            prompts, rollouts, rewards = timer.run(
                "dynamic_sampling", self.keep_informative_groups, prompts, rollouts, rewards
            )
        baseline = timer.run("baseline", self.greedy_baseline, prompts) if self._greedy_baseline else None
        values = timer.run("values", self.parts.critic.values, rollouts) if self.parts.critic else None
        penalty = timer.run("reference", self.kl_rewards, rollouts) if self.config.algorithm.kl_in == "reward" else None
        advantages = self.compute_advantage(rollouts, rewards, baseline, values, penalty)
        self.record_samples(prompts, rollouts, rewards, advantages)
        self.parts.buffer.put(self._experiences(prompts, rollouts, rewards, advantages))
        train_metrics = timer.run("train", self.update, self.parts.buffer.get(None, self.weight_version))
        if values is not None:
            timer.run("critic", self.update_critic, rollouts, advantages, values)
        self.adapt_kl_beta(train_metrics, len(rollouts))
        timer.run("sync", self.sync_weights)
        return self.finish_step(rollouts, rewards, train_metrics, timer.total())

    def scale_rollout(self, engines: int) -> None:
        """Grow or shrink the rollout pool between steps; new engines start on the current weights."""
        self.parts.rollout.scale(engines)

    def apply_rollout_schedule(self) -> None:
        """``scheduler.rollout_schedule``: the engine count of the latest entry at or before this step."""
        due = [step for step in self.config.scheduler.rollout_schedule if step <= self.step_count + 1]
        if due:
            wanted = self.config.scheduler.rollout_schedule[max(due)]
            if len(getattr(self.parts.rollout, "engines", ())) != wanted:
                self.scale_rollout(wanted)

    def generate(self, prompts: list[Prompt]) -> list[Rollout]:
        return self.parts.rollout.generate(prompts, self.sampling, self.weight_version)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        """Rewards in rollout order; a failed reward service makes the samples unscorable, and too
        many unscorable samples stop the run (:meth:`check_failure_rate`)."""
        requests = [
            ScoreRequest(prompts[r.prompt_index].text, r.text, prompts[r.prompt_index].columns, len(r.response_ids))
            for r in rollouts
        ]
        try:
            rewards = self.parts.reward.score_batch(requests)
        except RewardServiceError as exc:
            rewards = [RewardResult(reward=None, error=str(exc)) for _ in rollouts]
        self.check_failure_rate(prompts, rollouts, rewards)
        return rewards

    def update(self, experiences: list[Experience]) -> TrainMetrics:
        if self.in_critic_warmup():  # the policy waits while the critic learns values worth a baseline
            nan = float("nan")
            return TrainMetrics(nan, nan, nan, nan, nan, nan, nan, nan, 0, 0)
        batch = ExperienceBatch.from_experiences(experiences, self.parts.tokenizer.pad_token_id)
        self._updating = True  # from here on the weights change: an abandoned step cannot be undone
        return self.parts.trainer.update(batch)

    def record_samples(
        self,
        prompts: list[Prompt],
        rollouts: list[Rollout],
        rewards: list[RewardResult],
        advantages: list[float | list[float]],
    ) -> None:
        step = self.step_count + 1
        if self._samples_due(step):
            write_samples(
                self.config.run_dir / "samples" / f"step_{step}.jsonl", prompts, rollouts, rewards, advantages
            )

    def finish_step(
        self,
        rollouts: list[Rollout],
        rewards: list[RewardResult],
        train_metrics: TrainMetrics,
        timings: dict[str, float],
    ) -> StepMetrics:
        self.step_count += 1
        self._updating = False
        values = {**self._metrics(rollouts, rewards, train_metrics, timings), **self.step_stats}
        notes = {}
        reason = most_common_error(rewards)
        if reason:
            notes["unscorable_reason"] = reason
        if values["reward/no_signal_groups"] > 0:
            notes["no_signal"] = (
                f"{values['reward/no_signal_groups']:.0%} of groups have identical rewards (no advantage, no gradient)"
            )
        flags = Counter(f for r in rewards for f in r.flags)
        if flags:
            flag, count = flags.most_common(1)[0]
            notes["flagged"] = f"{sum(bool(r.flags) for r in rewards)} samples flagged, e.g. {count}x {flag}"
        return StepMetrics(step=self.step_count, weight_version=self.weight_version, values=values, notes=notes)

    def restore_abandoned_step(self) -> bool:
        """After a step was abandoned: put the run state back to the last completed step. False when
        the step had already started changing the weights (then that state is gone)."""
        if self._updating or self._pre_step_state is None:
            return False
        self.load_state_dict(self._pre_step_state, sync=False)
        return True

    def _samples_due(self, step: int) -> bool:
        lg = self.config.logging
        return step <= lg.samples_first_steps or (lg.samples_every > 0 and step % lg.samples_every == 0)

    def check_failure_rate(self, prompts: list[Prompt], rollouts: list[Rollout], rewards: list[RewardResult]) -> None:
        """Stop the run when too many samples could not be scored, keeping the step's samples on disk."""
        failed = [res for res in rewards if res.unscorable]
        limit = self.config.reward.max_failure_rate
        if not rewards or len(failed) / len(rewards) <= limit:
            return
        path = write_samples(
            self.config.run_dir / f"unscored_step_{self.step_count + 1}.jsonl", prompts, rollouts, rewards
        )
        reasons = Counter(res.error for res in failed).most_common(3)
        listed = "; ".join(f"{n}x {err}" for err, n in reasons)
        raise RewardFailureError(
            f"step {self.step_count + 1}: {len(failed)}/{len(rewards)} samples could not be scored "
            f"({len(failed) / len(rewards):.0%} > reward.max_failure_rate={limit}); most common: {listed}. "
            f"The step's samples are saved in {path}"
        )

    def compute_advantage(
        self,
        rollouts: list[Rollout],
        rewards: list[RewardResult],
        baseline: list[float] | None = None,
        values: list[list[float]] | None = None,
        token_rewards: list[list[float]] | None = None,
    ) -> list[float | list[float]]:
        """One advantage per sample, or per response token for token-level estimators (REINFORCE++,
        GAE); ``baseline``: a reward per prompt (ReMax's greedy response); ``values``: the critic's;
        ``token_rewards``: the per-token KL penalty."""
        entry = self.config.algorithm.advantage
        inputs = advantage_inputs(rollouts, rewards, baseline, values, token_rewards)
        return per_sample(ADVANTAGES.get(entry.type)(inputs, **entry.options()), rollouts)

    def check_engine(self, when: str) -> None:
        """Stop the run, with the engine's own reason, when the rollout engine cannot serve."""
        health = self.parts.rollout.health_check()
        if not health:
            raise EngineUnhealthyError(
                f"the rollout engine failed its health check {when}: "
                f"{getattr(health, 'reason', '') or 'no reason given'}"
            )

    def sync_weights(self, bump: bool = True) -> None:
        """Push the trainer's policy into the rollout worker under a new ``weight_version``, then
        check that the engine still serves."""
        if bump:
            self.weight_version += 1
        state = dedupe_tied(self.parts.trainer.policy_state())
        manifest = weight_manifest(state) if self.config.rollout.verify_sync else None
        if self.config.rollout.weight_sync == "safetensors":
            path = write_sync_file(state, self.sync_dir / "policy.safetensors")
            self.parts.rollout.update_weights(path, self.weight_version, manifest)
        else:
            self.parts.rollout.update_weights(state, self.weight_version, manifest)
        self.check_engine(f"after the weight sync to version {self.weight_version}")

    # -- helpers -------------------------------------------------------------------------------
    def _experiences(
        self,
        prompts: list[Prompt],
        rollouts: list[Rollout],
        rewards: list[RewardResult],
        advantages: list[float | list[float]],
    ) -> list[Experience]:
        out = []
        for r, res, adv in zip(rollouts, rewards, advantages):
            prompt = prompts[r.prompt_index]
            metadata = {
                "task_type": prompt.columns.get("task_type"),
                "source": prompt.source,
                "finish_reason": r.finish_reason,
                "components": res.components,
                "reasons": res.reasons,
                "unscorable": res.unscorable,
                "error": res.error,
            }
            out.append(
                Experience(
                    prompt_ids=r.prompt_ids,
                    response_ids=r.response_ids,
                    logprobs=r.logprobs,
                    reward=0.0 if res.reward is None else res.reward,
                    advantage=adv,
                    weight_version=r.weight_version,
                    metadata=metadata,
                    group_id=r.prompt_index,
                    logprob_versions=r.logprob_versions,
                    # an unscorable sample stays in the batch (its group's context) but weighs nothing
                    loss_mask=[0] * len(r.response_ids) if res.unscorable else None,
                )
            )
        return out

    def _metrics(self, rollouts, rewards, train, timings) -> dict[str, float]:
        scored = torch.tensor([r.reward for r in rewards if r.reward is not None], dtype=torch.float64)
        lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float64)
        nan = float("nan")
        v: dict[str, float] = {
            "reward/mean": float(scored.mean()) if scored.numel() else nan,
            "reward/std": float(scored.std(unbiased=False)) if scored.numel() else nan,
            "reward/min": float(scored.min()) if scored.numel() else nan,
            "reward/max": float(scored.max()) if scored.numel() else nan,
            "reward/unscorable": float(sum(r.unscorable for r in rewards)),
            "reward/flagged": float(sum(bool(r.flags) for r in rewards)),
            "reward/no_signal_groups": no_signal_fraction(rollouts, rewards),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
            "actor/loss": train.loss,
            "actor/kl": train.kl,
            "actor/kl_beta": self.kl_beta,
            "actor/entropy": train.entropy,
            "actor/clip_fraction": train.clip_fraction,
            "actor/clip_low": train.clip_low_fraction,
            "actor/clip_high": train.clip_high_fraction,
            "actor/dual_clip": train.dual_clip_fraction,
            "actor/approx_kl": train.approx_kl,
            "actor/grad_norm": train.grad_norm,
            "actor/lr": train.learning_rate,
            "actor/skipped_updates": float(train.skipped_steps),
            "rollout/mismatch_kl": train.mismatch_kl,
            "rollout/logprob_diff_max": train.logprob_diff_max,
            "perf/gen_tokens_per_s": float(lengths.sum()) / max(timings["generate"], 1e-9),
            "data/epoch": float(self.sampler.epoch),
            "data/skipped_rows": float(len(self.parts.dataset.skipped)),
        }
        for name in sorted({k for r in rewards for k in r.components}):
            vals = [r.components[name] for r in rewards if name in r.components]
            v[f"reward/{name}/mean"] = sum(vals) / len(vals)
        name = getattr(self.parts.reward, "accuracy_component", None)
        verified = [r.components[name] for r in rewards if name in r.components]
        if verified:
            v["accuracy"] = sum(x >= self.config.reward.accuracy_threshold for x in verified) / len(rewards)
        for name, seconds in timings.items():
            v[f"time/{name}_s"] = seconds
        return v

    # -- run state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "weight_version": self.weight_version,
            "sampler": self.sampler.state_dict(),
            "rollout": self.parts.rollout.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "kl_beta": self.kl_beta,
        }

    def load_state_dict(self, state: dict[str, Any], sync: bool = True) -> None:
        self.step_count = int(state["step"])
        self.weight_version = int(state["weight_version"])
        self.sampler.load_state_dict(state["sampler"])
        self.parts.rollout.load_state_dict(state["rollout"])
        torch.set_rng_state(state["torch_rng"])
        if "kl_beta" in state and self.config.algorithm.kl_target is not None:
            self.kl_beta = float(state["kl_beta"])
            self.parts.trainer.set_kl_beta(self.kl_beta)
        if sync:
            self.sync_weights(bump=False)
