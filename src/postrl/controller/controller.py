"""The Controller: one RL step as data flowing forward once.

The producer side samples prompts, generates, scores, lets the stages add what they need to one
:class:`~postrl.types.StepBatch` and puts its experiences into the Experience Buffer; the consumer
side gets them from the buffer, trains, runs the stages that learn from the update, and syncs the
new weights to the rollout engines. In sync mode a step is the producer then the consumer; in
async mode (:mod:`postrl.controller.async_pipeline`) the producer runs ahead in its own thread and
the weights reach the engines in the background.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from postrl.buffer import ExperienceStore
from postrl.config.run import RunConfig
from postrl.controller.advantage import compute_advantage
from postrl.controller.async_pipeline import BackgroundSync, BatchSteps, InlineProducer, ProducedBatch, Producer
from postrl.controller.episodes import EpisodeSource, trainable
from postrl.controller.failures import check_failure_rate
from postrl.controller.generated import Generated
from postrl.controller.lagging import mask_lagging_tokens
from postrl.controller.stages import Groups, StageContext, build_stages
from postrl.controller.stages.kl import KLCoefficient
from postrl.controller.step_metrics import (
    StageTimer,
    accuracy,
    operating_figures,
    reward_values,
    step_notes,
    write_samples,
)
from postrl.data import PromptDataset, PromptSampler
from postrl.models.weights import dedupe_tied, weight_manifest, write_sync_file
from postrl.reward.client import RewardServiceError
from postrl.rollout.agentic.episodes import episode_metrics
from postrl.rollout.base import ScalableRolloutWorker
from postrl.rollout.common import EngineUnhealthyError
from postrl.rollout.continuation import continue_rollouts
from postrl.types import (
    Experience,
    ExperienceBatch,
    Prompt,
    RewardResult,
    Rollout,
    SamplingParams,
    ScoreRequest,
    StepBatch,
    StepMetrics,
    TrainMetrics,
)
from postrl.workers.roles import Critic, RewardService, Scheduler, TrainWorker


class Tokenizer(Protocol):
    pad_token_id: int

    def save_pretrained(self, folder: Any) -> Any: ...


@dataclass
class Components:
    """Everything a Controller drives; built by :func:`postrl.run.train_runner.build_components`."""

    config: RunConfig
    tokenizer: Tokenizer
    dataset: PromptDataset
    rollout: ScalableRolloutWorker
    reward: RewardService
    trainer: TrainWorker
    buffer: ExperienceStore
    scheduler: Scheduler | None = None  # placed the workers; closed last
    critic: Critic | None = None  # when algorithm.critic is set (PPO with GAE)
    episodes: EpisodeSource | None = None  # an agent: run's episodes (built and checked before the run starts)


class Controller:
    def __init__(self, parts: Components, sync_dir: Path | None = None) -> None:
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
        self.kl = KLCoefficient(self.config.algorithm.kl_beta, parts.trainer)
        self.stages = build_stages(StageContext(self.config, self, parts.trainer, parts.critic, self.kl))
        self._pre_step_state: dict[str, Any] | None = None
        self._updating = False
        self.asynchronous = self.config.controller.mode == "async"
        self._versions = threading.Condition()  # the producer waits on it for versions to move
        self.engine_version = 0  # the newest version the engines hold (async: behind the trainer's)
        self.producer: Producer | InlineProducer | None = None
        self.syncer: BackgroundSync | None = None
        self._pipeline_state: dict[str, Any] | None = None
        self._report: ProducedBatch | None = None  # async: the batch the step in progress trains on
        self.episodes = parts.episodes
        self.last_sync_bytes = 0
        self.engine_healthy = True

    def start(self, state: dict[str, Any] | None = None) -> None:
        """Before the first step: restore a resumed run's state, then sync the weights once; in
        async mode, start the producer and the background sync."""
        if state is not None:
            self.load_state_dict(state)
        self.sync_weights(bump=False)
        self.engine_version = self.weight_version
        if self.asynchronous:
            self._start_pipeline()

    def _start_pipeline(self) -> None:
        c = self.config.controller
        self.syncer = BackgroundSync(self._push_weights, self._engines_hold, c.producer_threads, self._wake)
        failed = lambda: self.syncer is not None and self.syncer.error is not None  # noqa: E731
        deliver, total = self.parts.buffer.put, self.config.steps
        if self.config.async_overlap == "generation":
            steps = BatchSteps(self._generate_or_continue, self._score_and_finish, self.parts.rollout.suspend)
            self.producer = Producer(
                steps, deliver, self._may_start, total, self.step_count, self._versions, c.producer_threads, failed
            )
        else:
            self.producer = InlineProducer(
                self._begin_batch, self._score_batch, self._finish_batch, deliver, self._may_start, total,
                self.step_count, self._versions, failed,
            )  # fmt: skip
        if self._pipeline_state is not None:
            self.producer.load_state_dict(self._pipeline_state)
        self.producer.start()

    def _wake(self) -> None:
        with self._versions:
            self._versions.notify_all()

    def close(self) -> None:
        """Stop the async threads (the producer after its batch in progress) and an agent server."""
        if self.producer is not None:
            self.producer.stop()
        if self.syncer is not None:
            try:
                self.syncer.flush()
            finally:
                self.syncer.close()
        if self.episodes is not None:
            self.episodes.close()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> StepMetrics:
        """One RL step: the producer side, then the consumer side; the timer records each stage.
        In async mode the producer side ran ahead: the step trains on its oldest batch."""
        if self.asynchronous:
            return self._async_step()
        self.apply_rollout_schedule()
        timer, metrics = StageTimer(), dict[str, float]()
        self._pre_step_state, self._updating = self.state_dict(), False
        step = self.produce(timer, metrics, self.step_count + 1)
        report = self.produced_report(step, timer.seconds, metrics)
        self.parts.buffer.put(step.experiences())
        consumed: dict[str, float] = {}
        train = self.consume(timer, consumed)
        return self.finish_step(report, train, consumed, timer.total())

    def _async_step(self) -> StepMetrics:
        assert self.producer is not None
        timer, metrics = StageTimer(), dict[str, float]()
        self._updating = False
        self._report = timer.run("wait", self.producer.next_report)
        train = self.consume(timer, metrics)
        report, self._report = self._report, None
        metrics["time/producer_waited_s"] = self.producer.waited_s
        metrics["rollout/suspended_batches"] = float(self.producer.suspended)
        if self.syncer is not None:
            metrics["time/weight_push_s"] = self.syncer.last_s
        return self.finish_step(report, train, metrics, timer.total())

    def _generate_or_continue(self, number: int, resumed: Generated | None) -> tuple[Generated, StageTimer]:
        """The producer thread's generation of batch ``number``, or the continuation of its
        suspended rollouts (a checkpoint stopped the engines mid-batch)."""
        timer = StageTimer()
        if resumed is None:
            return self.generate_batch(timer, number), timer
        rollouts = timer.run(
            "generate", continue_rollouts, self.generate, resumed.prompts, resumed.rollouts, self.sampling,
            self.parts.tokenizer,
        )  # fmt: skip
        return dataclasses.replace(resumed, rollouts=rollouts), timer

    def _score_and_finish(self, begun: tuple[Generated, StageTimer]) -> tuple[list[Experience], ProducedBatch]:
        return self._finish_batch(begun, self._score_batch(begun))

    def _begin_batch(self, number: int) -> tuple[Generated, StageTimer]:
        timer = StageTimer()
        return self.generate_batch(timer, number), timer

    def _score_batch(self, begun: tuple[Generated, StageTimer]) -> list[RewardResult]:
        generated, timer = begun
        return timer.run("reward", self.score, generated.prompts, generated.rollouts)

    def _finish_batch(
        self, begun: tuple[Generated, StageTimer], rewards: list[RewardResult]
    ) -> tuple[list[Experience], ProducedBatch]:
        generated, timer = begun
        metrics: dict[str, float] = {}
        step = self.prepare_batch(generated, rewards, timer, metrics)
        return step.experiences(), self.produced_report(
            step, {**timer.seconds, "produce": timer.total()["step"]}, metrics
        )

    def _may_start(self, batch: int) -> bool:
        """Batch ``batch`` (from 1) trains under version ``batch - 1``: it may start once its lag
        can stay within max_staleness (with on_stale=wait, once the engines hold that version)."""
        needed = batch - 1 - self.config.buffer.max_staleness
        held = self.engine_version if self.config.buffer.on_stale == "wait" else self.weight_version
        return held >= needed

    def produce(self, timer: StageTimer, metrics: dict[str, float], number: int) -> StepBatch:
        """Sample, generate, score, prepare advantages: batch ``number`` of the run."""
        generated = self.generate_batch(timer, number)
        rewards = timer.run("reward", self.score, generated.prompts, generated.rollouts)
        return self.prepare_batch(generated, rewards, timer, metrics)

    def generate_batch(self, timer: StageTimer, number: int) -> Generated:
        """Batch ``number``: its prompts drawn and generated. A generation that fails (or is
        abandoned) gives its prompts back to the sampler, so the batch is drawn again."""
        drawn_from = self.sampler.state_dict()
        prompts = self.sample_prompts()
        try:
            rollouts = timer.run("generate", self.generate, prompts)
        except BaseException:
            self.sampler.load_state_dict(drawn_from)
            raise
        return Generated(number, prompts, rollouts, time.time())

    def prepare_batch(
        self, generated: Generated, rewards: list[RewardResult], timer: StageTimer, metrics: dict[str, float]
    ) -> StepBatch:
        """After scoring: the stages that select groups, one StepBatch, the stages that prepare it,
        the advantages."""
        number = generated.number
        scored = Groups(generated.prompts, generated.rollouts, rewards)
        groups = self.select_groups(scored if self.episodes is None else trainable(scored, number), timer, metrics)
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
        self.record_samples(step, number)
        return step

    def produced_report(
        self, step: StepBatch, seconds: dict[str, float], stage_metrics: dict[str, float]
    ) -> ProducedBatch:
        """The producer side's metrics of ``step``: rewards, lengths, accuracy, generation speed,
        its stages' metrics and timings."""
        rollouts, rewards = step.rollouts, step.results
        values = {
            **reward_values(rollouts, rewards),
            "perf/gen_tokens_per_s": sum(len(r.response_ids) for r in rollouts) / max(seconds["generate"], 1e-9),
            "reward/samples": float(len(rewards)),
            "data/epoch": float(self.sampler.epoch),
            "data/skipped_rows": float(len(self.parts.dataset.skipped)),
            "rollout/weight_version": float(min(r.weight_version for r in rollouts)),
            "rollout/partial_rollouts": float(sum(r.token_versions() is not None for r in rollouts)),
            **accuracy(rewards, self.accuracy_name, self.config.reward.accuracy_threshold),
            **{f"time/{name}_s": value for name, value in seconds.items()},
            **stage_metrics,
            **episode_metrics(rollouts),
        }
        return ProducedBatch(values, step_notes(rewards, values["reward/no_signal_groups"]))

    @property
    def accuracy_name(self) -> str | None:
        """The reward component that is the ``accuracy`` metric (an agent run's environment reward)."""
        return "environment" if self.episodes and self.episodes.scores_itself else self.parts.reward.accuracy_component

    def consume(self, timer: StageTimer, metrics: dict[str, float]) -> TrainMetrics:
        """Get a step's experiences from the buffer, train, learn from the update, sync."""
        taken = self.parts.buffer.get(self.train_batch_size, self.weight_version)
        self._updating = self._updating or self.asynchronous  # async: what was taken cannot be put back
        metrics.update(taken.metrics())
        if not taken.experiences:  # every one was too stale: nothing to train on this step
            return TrainMetrics.skipped()
        batch = ExperienceBatch.from_experiences(taken.experiences, self.parts.tokenizer.pad_token_id)
        batch = batch.with_lags(self.weight_version)
        if self.config.algorithm.max_token_lag is not None:
            batch, masked = mask_lagging_tokens(batch, self.config.algorithm.max_token_lag)
            metrics["buffer/lag_masked_tokens"] = masked
        train = timer.run("train", self.update, batch)
        metrics["perf/train_tokens_per_s"] = float(batch.attention_mask.sum()) / max(timer.seconds["train"], 1e-9)
        for stage in self.stages.after_update:
            metrics.update(timer.run(stage.timer_name("after_update"), stage.after_update, batch, train))
        timer.run("sync", self.sync_weights)
        return train

    @property
    def train_batch_size(self) -> int | None:
        """Experiences per update: with replay, a step's worth sampled from the buffer; else one
        producer batch (None)."""
        return None if self.config.buffer.replay is None else self.config.prompts_per_step * self.config.rollout.n

    def sample_prompts(self) -> list[Prompt]:
        return [self.parts.dataset[i] for i in self.sampler.next_indices(self.config.prompts_per_step)]

    def generate(self, prompts: list[Prompt], sampling: SamplingParams | None = None) -> list[Rollout]:
        """In async mode on whatever weights the engines hold (each rollout says which)."""
        version = None if self.asynchronous else self.weight_version
        if self.episodes is not None:
            return self.episodes.run(self.parts.rollout, prompts, sampling or self.sampling, version)
        return self.parts.rollout.generate(prompts, sampling or self.sampling, version)

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
        """Rewards in rollout order; a failed reward service makes the samples unscorable, and too
        many unscorable samples stop the run (:func:`~postrl.controller.failures.check_failure_rate`)."""
        if self.episodes is not None:
            rewards = self.episodes.score(prompts, rollouts, self.parts.reward)
        else:
            requests = [ScoreRequest(prompts[r.prompt_index].text, r.text, prompts[r.prompt_index].columns,
                                     len(r.response_ids)) for r in rollouts]  # fmt: skip
            try:
                rewards = self.parts.reward.score_batch(requests)
            except RewardServiceError as exc:
                rewards = [RewardResult(reward=None, error=str(exc)) for _ in rollouts]
        c = self.config
        check_failure_rate(c.run_dir, self.step_count + 1, c.reward.max_failure_rate, prompts, rollouts, rewards)
        return rewards

    def select_groups(self, groups: Groups, timer: StageTimer, metrics: dict[str, float]) -> Groups:
        for stage in self.stages.select:
            groups, produced = timer.run(stage.timer_name("select"), stage.select, groups)
            metrics.update(produced)
        return groups

    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        if self.stages.policy_waits(self.step_count):
            return TrainMetrics.skipped()
        self._updating = True  # from here on the weights change: an abandoned step cannot be undone
        return self.parts.trainer.update(batch)

    def record_samples(self, step: StepBatch, number: int) -> None:
        lg = self.config.logging
        if number <= lg.samples_first_steps or (lg.samples_every > 0 and number % lg.samples_every == 0):
            path = self.config.run_dir / "samples" / f"step_{number}.jsonl"
            write_samples(path, step.prompts, step.rollouts, step.results, step)

    def finish_step(
        self, report: ProducedBatch, train: TrainMetrics, consumed: dict[str, float], timings: dict[str, float]
    ) -> StepMetrics:
        self.step_count += 1
        self._updating = False
        values = {
            **report.values,
            **train.values,
            "actor/kl_beta": self.kl.beta,
            **{f"time/{name}_s": seconds for name, seconds in timings.items()},
            **consumed,
            **self.operations(),
        }
        return StepMetrics(step=self.step_count, weight_version=self.weight_version, values=values, notes=report.notes)

    def operations(self) -> dict[str, float]:
        p = self.parts
        return operating_figures(p.rollout, p.reward, p.buffer, self.engine_healthy, self.last_sync_bytes)

    def restore_abandoned_step(self) -> bool:
        """After a step was abandoned: put the run state back to the last completed step. False when
        the step had already started changing the weights (then that state is gone)."""
        if self._updating:
            return False
        if self.asynchronous:  # nothing was taken from the buffer yet: the batch's report goes back
            if self._report is not None and self.producer is not None:
                with self._versions:
                    self.producer.reports.appendleft(self._report)
                self._report = None
            return True
        if self._pre_step_state is None:
            return False
        self.load_state_dict(self._pre_step_state)
        return True

    # -- the rollout engines -----------------------------------------------------------------------
    def scale_rollout(self, engines: int) -> None:
        """Grow or shrink the rollout pool between steps; new engines start on the current weights."""
        self.parts.rollout.scale(engines)

    def apply_rollout_schedule(self) -> None:
        """``scheduler.rollout_schedule``: the engine count of the latest entry at or before this step."""
        due = [step for step in self.config.scheduler.rollout_schedule if step <= self.step_count + 1]
        if due:
            wanted = self.config.scheduler.rollout_schedule[max(due)]
            if len(self.parts.rollout.engines) != wanted:
                self.scale_rollout(wanted)

    def check_engine(self, when: str) -> None:
        """Stop the run, with the engine's own reason, when the rollout engine cannot serve."""
        health = self.parts.rollout.health_check()
        self.engine_healthy = bool(health)
        if not health:
            raise EngineUnhealthyError(
                f"the rollout engine failed its health check {when}: {health.reason or 'no reason given'}"
            )

    def sync_weights(self, bump: bool = True) -> None:
        """Push the trainer's policy into the rollout worker under a new ``weight_version``, then
        check that the engine still serves. In async mode (after the start) a copy of the weights
        goes to the background sync and the step goes on."""
        if bump:
            with self._versions:
                self.weight_version += 1
                self._versions.notify_all()
        state = dedupe_tied(self.parts.trainer.policy_state())
        if self.syncer is None:
            self._push_weights(state, self.weight_version)
            return
        self.syncer.post({k: v.detach().clone() for k, v in state.items()}, self.weight_version)

    def _push_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        manifest = weight_manifest(state) if self.config.rollout.verify_sync else None
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in state.values())
        if self.config.rollout.weight_sync == "safetensors":
            if self.sync_dir is None:
                raise ValueError("rollout.weight_sync=safetensors needs the Controller's sync_dir")
            path = write_sync_file(state, self.sync_dir / "policy.safetensors")
            self.parts.rollout.update_weights(path, version, manifest)
        else:
            self.parts.rollout.update_weights(state, version, manifest)
        self.check_engine(f"after the weight sync to version {version}")

    def _engines_hold(self, version: int) -> None:
        with self._versions:
            self.engine_version = version
            self._versions.notify_all()

    # -- run state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run state after the last completed step; in async mode the producer is held between
        two batches meanwhile, and its count and unconsumed reports are part of it."""
        if self.producer is None:
            return self._state()
        with self.producer.paused():
            return {**self._state(), "pipeline": self.producer.state_dict()}

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "weight_version": self.weight_version,
            "sampler": self.sampler.state_dict(),
            "rollout": self.parts.rollout.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "stages": self.stages.state_dict(),
            "buffer": self.parts.buffer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        self.weight_version = int(state["weight_version"])
        self.sampler.load_state_dict(state["sampler"])
        self.parts.rollout.load_state_dict(state["rollout"])
        torch.set_rng_state(state["torch_rng"])
        self.stages.load_state_dict(state["stages"])
        self.parts.buffer.load_state_dict(state["buffer"])
        self._pipeline_state = state.get("pipeline")
