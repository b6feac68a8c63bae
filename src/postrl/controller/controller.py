"""The Controller: one RL step as data flowing forward once.

A step takes the report of a batch the pipeline put into the Experience Buffer (made by the
:class:`~postrl.controller.batches.BatchMaker`: sample, generate, score, prepare advantages), gets
its experiences from the buffer, trains, runs the stages that learn from the update, and publishes
the new weights to the rollout engines. The pipeline (:mod:`postrl.controller.pipeline`) decides
when batches are made and how weights travel: within the step (sync), or ahead of it and in the
background (async); the step is the same code either way.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from postrl.controller.advantage import rollout_advantages
from postrl.controller.async_pipelines import InlinePipeline, ThreadedPipeline
from postrl.controller.batches import BatchMaker
from postrl.controller.components import Components
from postrl.controller.overlap import resolve_overlap
from postrl.controller.pipeline import Pipeline, ProducedBatch, SyncPipeline, Weights, ledger_state
from postrl.controller.stages.kl import KLCoefficient
from postrl.controller.step_metrics import StageTimer, operating_figures
from postrl.controller.versions import Versions
from postrl.models.weights import weight_manifest
from postrl.rollout.common import EngineUnhealthyError
from postrl.types import ExperienceBatch, Prompt, RewardResult, Rollout, StepMetrics, TrainMetrics
from postrl.types.metric_names import ACTOR_KL_BETA, BUFFER_LAG_MASKED_TOKENS, PERF_TRAIN_TOKENS_PER_S, seconds_of

log = logging.getLogger(__name__)


class Controller:
    def __init__(self, parts: Components) -> None:
        self.parts = parts
        self.config = parts.config
        self.versions = Versions()
        self.kl = KLCoefficient(self.config.algorithm.kl_beta, parts.trainer)
        self.source = parts.source
        self.batches = BatchMaker(parts, self.source, self.versions, self.kl)
        self.stages = self.batches.stages
        self.pipeline = self._make_pipeline()
        self._report: ProducedBatch | None = None  # the batch the step in progress trains on
        self._taken = self._updating = False  # the step in progress took experiences; changed the weights
        self.last_sync_bytes = 0
        self.engine_healthy = True

    def _make_pipeline(self) -> Pipeline:
        """The pipeline ``controller.mode`` and ``controller.overlap`` ask for."""
        c, steps, deliver = self.config, self.batches, self.parts.buffer.put
        if c.controller.mode == "sync":
            return SyncPipeline(steps, deliver, self.versions, self._push_weights, self._undo_point, self._undo)
        overlap = resolve_overlap(c)
        if overlap.runs == "generation":
            return ThreadedPipeline(steps, deliver, self.versions, self._push_weights, c)
        if overlap.requested == "generation":
            log.warning(
                "controller.overlap=generation: the engine computes on the trainer's CPU, where a producer thread "
                "generating beside the update is slower than sync, so the next batch is generated between updates "
                "and scored beside them (overlap=scoring); controller.serial_compute=false keeps the producer thread"
            )
        return InlinePipeline(steps, deliver, self.versions, self._push_weights, c)

    @property
    def step_count(self) -> int:
        return self.versions.step

    @property
    def weight_version(self) -> int:
        return self.versions.weight

    def start(self, state: dict[str, Any] | None = None) -> None:
        """Before the first step: restore a resumed run's state, then push the weights to the
        engines (and wait for them to hold them)."""
        if state is not None:
            self.load_state_dict(state)
        self._push_weights(self.parts.trainer.policy_state(), self.versions.weight)
        self.versions.engines_hold(self.versions.weight)

    def close(self) -> None:
        """Stop the pipeline's threads (the producer after its batch in progress) and the batch source."""
        try:
            self.pipeline.close()
        finally:
            self.source.close()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> StepMetrics:
        """One RL step: the batch the pipeline made (in sync mode, now), the update, the sync; the
        timer records each stage."""
        self.apply_rollout_schedule()
        timer, consumed = StageTimer(), dict[str, float]()
        self._taken = self._updating = False
        self._report = self.pipeline.next_report(timer)
        train = self.consume(timer, consumed)
        report, self._report = self._report, None
        return self.finish_step(report, train, {**consumed, **self.pipeline.metrics()}, timer.total())

    def consume(self, timer: StageTimer, metrics: dict[str, float]) -> TrainMetrics:
        """Get a step's experiences from the buffer, train, learn from the update, sync."""
        if self._report is not None and not self._report.trainable:  # it put nothing into the buffer
            timer.run("sync", self.sync_weights)  # the same weights, a new version: versions keep to steps
            return TrainMetrics.skipped()
        taken = self.parts.buffer.get(self.train_batch_size, self.versions.weight)
        self._taken = True
        metrics.update(taken.metrics())
        if not taken.experiences:  # every one was too stale: nothing to train on this step
            return TrainMetrics.skipped()
        batch = ExperienceBatch.from_experiences(taken.experiences, self.parts.tokenizer.pad_token_id)
        batch = batch.with_lags(self.versions.weight)
        if self.config.algorithm.max_token_lag is not None:
            batch, masked = batch.without_lagging_tokens(self.config.algorithm.max_token_lag)
            metrics[BUFFER_LAG_MASKED_TOKENS] = masked
        train = timer.run("train", self.update, batch)
        metrics[PERF_TRAIN_TOKENS_PER_S] = float(batch.attention_mask.sum()) / max(timer.seconds["train"], 1e-9)
        for stage in self.stages.after_update:
            metrics.update(timer.run(stage.timer_name("after_update"), stage.after_update, batch, train))
        timer.run("sync", self.sync_weights)
        return train

    @property
    def train_batch_size(self) -> int | None:
        """Experiences per update: with replay, a step's worth sampled from the buffer; else one
        producer batch (None)."""
        return None if self.config.buffer.replay is None else self.config.prompts_per_step * self.config.rollout.n

    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        if self.stages.policy_waits(self.versions.step):
            return TrainMetrics.skipped()
        self._updating = True  # from here on the weights change: an abandoned step cannot be undone
        return self.parts.trainer.update(batch)

    # -- the design's entry points (../shared/DESIGN.md): a step does these itself ----------------
    def sample_prompts(self) -> list[Prompt]:
        """The next batch's prompts, drawn as a step draws them (the run's sampler moves on)."""
        return self.batches.sample_prompts()

    def compute_advantage(self, rollouts: list[Rollout], rewards: list[RewardResult]) -> list[float | list[float]]:
        """Each rollout's advantage under the run's ``algorithm.advantage``, grouped by
        ``prompt_index`` (:func:`~postrl.controller.advantage.rollout_advantages`)."""
        return rollout_advantages(rollouts, rewards, self.config.algorithm, self.parts.tokenizer.pad_token_id)

    def finish_step(
        self, report: ProducedBatch, train: TrainMetrics, consumed: dict[str, float], timings: dict[str, float]
    ) -> StepMetrics:
        self.versions.step += 1
        self._updating = False
        values = {
            **report.values,
            **train.values,
            ACTOR_KL_BETA: self.kl.beta,
            **{seconds_of(name): seconds for name, seconds in timings.items()},
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
        report, self._report = self._report, None
        return self.pipeline.give_back(report, self._taken)

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
        health = self.parts.rollout.health()
        self.engine_healthy = bool(health)
        if not health:
            raise EngineUnhealthyError(
                f"the rollout engine failed its health check {when}: {health.reason or 'no reason given'}"
            )

    def sync_weights(self) -> None:
        """The trainer's policy under a new ``weight_version``, published to the rollout engines
        (sync: now, then the engine's health is checked; async: by the background sync)."""
        version = self.versions.bump()
        self.pipeline.publish(self.parts.trainer.policy_state(), version)

    def _push_weights(self, state: Weights, version: int) -> None:
        manifest = weight_manifest(state) if self.config.rollout.verify_sync else None
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in state.values())
        self.parts.rollout.update_weights(state, version, manifest)
        self.check_engine(f"after the weight sync to version {version}")

    # -- run state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run state after the last completed step; in async mode the producer is held between
        two batches meanwhile, and its count and unconsumed reports are part of it."""
        with self.pipeline.paused():
            return {**self._state(), "pipeline": self.pipeline.state_dict()}

    def _state(self) -> dict[str, Any]:
        return {**self._step_state(), "buffer": self.parts.buffer.state_dict()}

    def _step_state(self) -> dict[str, Any]:
        """The run state a sync step changes before its update, less the buffer's contents."""
        return {
            "step": self.versions.step,
            "weight_version": self.versions.weight,
            "sampler": self.batches.draw.state_dict(),
            "rollout": self.parts.rollout.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "stages": self.stages.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_step_state(state)
        self.parts.buffer.load_state_dict(state["buffer"])
        self.pipeline.load_state_dict(state.get("pipeline") or ledger_state(self.versions.step, deque()))

    def _load_step_state(self, state: dict[str, Any]) -> None:
        self.versions.step = int(state["step"])
        self.versions.weight = int(state["weight_version"])
        self.batches.draw.load_state_dict(state["sampler"])
        self.parts.rollout.load_state_dict(state["rollout"])
        torch.set_rng_state(state["torch_rng"])
        self.stages.load_state_dict(state["stages"])

    def _undo_point(self) -> dict[str, Any]:
        """Where a sync step starts, to go back to should it be abandoned before its update: the
        buffer only marks its entries (no copy of its experiences, no transfer from a Ray actor)."""
        self.parts.buffer.mark()
        return self._step_state()

    def _undo(self, point: dict[str, Any]) -> None:
        self._load_step_state(point)
        self.parts.buffer.rewind()
