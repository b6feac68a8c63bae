"""One policy's workers, placed by its scheduler: what a one-policy run and each policy of a
several-policy run build alike (:func:`place_policy`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from postrl.config.run import RunConfig
from postrl.models.numerics import Numerics
from postrl.rollout.factory import EngineSpec
from postrl.scheduling.base import Scheduler
from postrl.train.critic import CriticSpec
from postrl.train.factory import PolicySpec
from postrl.train.teachers.teachers import TeacherSpec
from postrl.workers.roles import Critic, ExperienceStore, ScalableRolloutWorker, Teachers, TrainWorker


@dataclass(frozen=True)
class PolicyWorkers:
    """One policy's workers, as its scheduler placed them."""

    trainer: TrainWorker
    rollout: ScalableRolloutWorker  # a RolloutPool
    buffer: ExperienceStore
    critic: Critic | None
    teachers: Teachers | None


def place_policy(
    scheduler: Scheduler, config: RunConfig, tokenizer: Any, numerics: Numerics, built: list[Any]
) -> PolicyWorkers:
    """``config``'s policy's trainer, engines, buffer, critic and teachers, placed by ``scheduler``;
    each is added to ``built`` as it starts, so that a failure closes the ones already running."""

    def started(part: Any) -> Any:
        built.append(part)
        return part

    trainer = started(scheduler.train_group(PolicySpec.of_run(config, numerics)))
    rollout = started(scheduler.rollout_pool(EngineSpec.of_run(config), tokenizer))
    buffer = started(scheduler.experience_buffer(config.buffer, config.seed))
    critic = teachers = None
    if config.algorithm.critic is not None:
        critic = started(scheduler.critic_worker(CriticSpec.of_run(config, tokenizer.pad_token_id)))
    if config.algorithm.distill is not None:
        teachers = started(scheduler.teachers(TeacherSpec.of_run(config)))
    return PolicyWorkers(trainer, rollout, buffer, critic, teachers)
