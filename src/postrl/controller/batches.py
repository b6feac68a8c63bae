"""The producer side of a step: a batch's prompts drawn, generated and scored by the run's batch
source, the stages that select and prepare, one :class:`~postrl.types.StepBatch`, its advantages,
the samples file and the batch's report. The pipeline decides when a batch is made; this is how."""

from __future__ import annotations

import dataclasses
import time

from postrl.config.rollout import RolloutConfig
from postrl.controller.advantage import compute_advantage
from postrl.controller.components import Components
from postrl.controller.failures import check_failure_rate
from postrl.controller.generated import Generated
from postrl.controller.pipeline import Batch, ProducedBatch
from postrl.controller.source import BatchSource
from postrl.controller.stages import Groups, StageContext, build_stages
from postrl.controller.stages.kl import KLCoefficient
from postrl.controller.step_metrics import StageTimer, reward_values, step_notes, write_samples
from postrl.controller.versions import Versions
from postrl.reward.accuracy import accuracy, per_task_accuracy
from postrl.rollout.agentic.episodes import episode_metrics
from postrl.types import Experience, Prompt, RewardResult, Rollout, SamplingParams, StepBatch
from postrl.types.metric_names import (
    ACCURACY,
    DATA_EPOCH,
    DATA_SKIPPED_ROWS,
    PERF_GEN_TOKENS_PER_S,
    REWARD_NO_SIGNAL_GROUPS,
    REWARD_SAMPLES,
    REWARD_UNSCORABLE,
    ROLLOUT_PARTIAL_ROLLOUTS,
    ROLLOUT_WEIGHT_VERSION,
    seconds_of,
)


def run_sampling(rollout: RolloutConfig) -> SamplingParams:
    """The sampling parameters of the run's training rollouts."""
    r = rollout
    stop, stop_ids = tuple(r.stop), tuple(r.stop_token_ids)
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=r.max_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
    )


def greedy_sampling(rollout: RolloutConfig, max_tokens: int | None = None) -> SamplingParams:
    """Held-out answers (validation, ``postrl eval``): one greedy response, the run's stops."""
    stop, stop_ids = tuple(rollout.stop), tuple(rollout.stop_token_ids)
    return SamplingParams(
        n=1, temperature=0.0, max_tokens=max_tokens or rollout.max_tokens, stop=stop, stop_token_ids=stop_ids
    )


class BatchMaker:
    """Makes the run's batches (:class:`~postrl.controller.pipeline.BatchSteps`), and is what the
    stages may ask of the step (:class:`~postrl.controller.stages.StepServices`): more prompts,
    generations and scores."""

    def __init__(self, parts: Components, source: BatchSource, versions: Versions, kl: KLCoefficient) -> None:
        self.parts = parts
        self.config = parts.config
        self.source = source
        self.versions = versions
        c = self.config
        self.draw = parts.prompts.draw(c.seed)
        self.sampling = run_sampling(c.rollout)
        self.pins_version = c.controller.mode == "sync"  # async: generate on whatever the engines hold
        context = StageContext(
            c, self, parts.trainer, parts.critic, kl, self.draw, source.accuracy_component, parts.teachers
        )
        self.stages = build_stages(context)  # last: self is whole

    # -- what stages may ask -------------------------------------------------------------------
    def sample_prompts(self) -> list[Prompt]:
        return self.draw.next_prompts(self.config.prompts_per_step)

    @property
    def generation_version(self) -> int | None:
        """The weight version generation asks the engines for (None: the one they hold)."""
        return self.versions.weight if self.pins_version else None

    def generate(self, prompts: list[Prompt], sampling: SamplingParams | None = None) -> list[Rollout]:
        return self.source.generate(prompts, sampling or self.sampling, self.generation_version)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        """Rewards in rollout order; too many unscorable samples stop the run
        (:func:`~postrl.controller.failures.check_failure_rate`)."""
        rewards = self.source.score(prompts, rollouts)
        c = self.config
        check_failure_rate(c.run_dir, self.versions.step + 1, c.reward.max_failure_rate, prompts, rollouts, rewards)
        return rewards

    # -- a batch, step by step -----------------------------------------------------------------
    def begin(self, number: int, timer: StageTimer, alone: bool) -> Batch:
        """Batch ``number``: its prompts drawn and generated. A generation that fails (or is
        abandoned) gives its prompts back to the sampler, so the batch is drawn again."""
        drawn_from = self.draw.state_dict()
        prompts = self.sample_prompts()
        try:
            rollouts = timer.run("generate", self.generate, prompts)
        except BaseException:
            self.draw.load_state_dict(drawn_from)
            raise
        return Batch(Generated(number, prompts, rollouts, time.time()), timer, alone)

    def resume(self, suspended: Generated) -> Batch:
        """The rollouts (or episodes) a checkpoint suspended, continued on the engines."""
        timer = StageTimer()
        rollouts = timer.run(
            "generate",
            self.source.resume,
            suspended.prompts,
            suspended.rollouts,
            self.sampling,
            self.generation_version,
        )
        return Batch(dataclasses.replace(suspended, rollouts=rollouts), timer, alone=True)

    def score_batch(self, batch: Batch) -> list[RewardResult]:
        return batch.timer.run("reward", self.score, batch.generated.prompts, batch.generated.rollouts)

    def suspend(self) -> bool:
        return self.source.suspend()

    def finish(self, batch: Batch, rewards: list[RewardResult]) -> tuple[list[Experience], ProducedBatch]:
        """The stages that select groups, one StepBatch, the stages that prepare it, the advantages;
        its experiences and its report."""
        generated, timer = batch.generated, batch.timer
        number, metrics = generated.number, dict[str, float]()
        groups = self.select_groups(
            self.source.trainable(Groups(generated.prompts, generated.rollouts, rewards), number), timer, metrics
        )
        if not groups.rollouts:  # a policy that took no turn in the batch's episodes
            return [], self.nothing_to_train(timer, batch.alone)
        step = StepBatch.build(
            groups.prompts,
            groups.rollouts,
            groups.rewards,
            self.parts.tokenizer.pad_token_id,
            batch=number,
            generated_at=generated.generated_at,
            scored_at=time.time(),
        )
        for stage in self.stages.prepare:
            metrics.update(timer.run(stage.timer_name("prepare"), stage.prepare, step))
        compute_advantage(step, self.config.algorithm)
        for stage in self.stages.after_advantage:
            metrics.update(timer.run(stage.timer_name("after_advantage"), stage.after_advantage, step))
        self.record_samples(step, number)
        seconds = {**timer.seconds, "produce": timer.total()["step"]} if batch.alone else timer.seconds
        return step.experiences(), self.report(step, seconds, metrics, rewards)

    def nothing_to_train(self, timer: StageTimer, alone: bool) -> ProducedBatch:
        """The report of a batch with no sample of this policy: its step trains nothing."""
        seconds = {**timer.seconds, "produce": timer.total()["step"]} if alone else timer.seconds
        values = {
            REWARD_SAMPLES: 0.0,
            DATA_EPOCH: float(self.draw.epoch),
            **{seconds_of(name): value for name, value in seconds.items()},
        }
        notes = {"no_samples": "no sample: the policy took no turn in this batch's episodes"}
        return ProducedBatch(values, notes, trainable=False)

    def select_groups(self, groups: Groups, timer: StageTimer, metrics: dict[str, float]) -> Groups:
        for stage in self.stages.select:
            groups, produced = timer.run(stage.timer_name("select"), stage.select, groups)
            metrics.update(produced)
        return groups

    def record_samples(self, step: StepBatch, number: int) -> None:
        lg = self.config.logging
        if number <= lg.samples_first_steps or (lg.samples_every > 0 and number % lg.samples_every == 0):
            path = self.config.run_dir / "samples" / f"step_{number}.jsonl"
            write_samples(path, step.prompts, step.rollouts, step.results, step)

    def report(
        self, step: StepBatch, seconds: dict[str, float], stage_metrics: dict[str, float], scored: list[RewardResult]
    ) -> ProducedBatch:
        """The producer side's metrics of ``step``: rewards, lengths, accuracy, generation speed,
        its stages' metrics and timings. ``scored``: every sample the batch scored, those left out
        of the step included (an episode that failed before a model turn has nothing to train on):
        the samples and unscorable counts, and the console's reason, are theirs."""
        rollouts, rewards = step.rollouts, step.results
        acc = accuracy(rewards, self.source.accuracy_component, self.config.reward.accuracy_threshold)
        values = {
            **reward_values(rollouts, rewards),
            PERF_GEN_TOKENS_PER_S: sum(len(r.response_ids) for r in rollouts) / max(seconds["generate"], 1e-9),
            REWARD_SAMPLES: float(len(scored)),
            REWARD_UNSCORABLE: float(sum(r.unscorable for r in scored)),
            DATA_EPOCH: float(self.draw.epoch),
            DATA_SKIPPED_ROWS: float(len(self.parts.prompts.train().skipped)),
            ROLLOUT_WEIGHT_VERSION: float(min(r.weight_version for r in rollouts)),
            ROLLOUT_PARTIAL_ROLLOUTS: float(sum(r.token_versions() is not None for r in rollouts)),
            **({} if acc is None else {ACCURACY: acc}),
            **per_task_accuracy(
                step.prompts, rollouts, rewards, self.source.accuracy_component, self.config.reward.accuracy_threshold
            ),
            **{seconds_of(name): value for name, value in seconds.items()},
            **stage_metrics,
            **episode_metrics(rollouts),
        }
        notes = step_notes(scored, values[REWARD_NO_SIGNAL_GROUPS], self.config.algorithm.distill)
        return ProducedBatch(values, notes)
