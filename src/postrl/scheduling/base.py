"""What a scheduler is: it places the workers of a run, each built from its spec (a
:class:`~postrl.train.factory.PolicySpec`, an :class:`~postrl.rollout.factory.EngineSpec`, a
:class:`~postrl.train.critic.CriticSpec`, a :class:`~postrl.train.dpo.PreferenceSpec`, a
:class:`~postrl.train.teachers.teachers.TeacherSpec`), and hands each role out as a client made from its
Protocol. Where a worker runs (this process, a child process, a Ray actor) is the scheduler's only
decision; what it is, is its spec's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from postrl.config.off_policy import BufferConfig
from postrl.config.run import RewardConfig
from postrl.rollout.factory import EngineSpec
from postrl.rollout.pool import RolloutPool
from postrl.train.critic import CriticSpec
from postrl.train.dpo import PreferenceSpec
from postrl.train.factory import PolicySpec
from postrl.train.teachers.teachers import TeacherSpec
from postrl.workers.roles import Critic, ExperienceStore, PreferenceTrainer, RewardService, Teachers, TrainWorker

RewardFactory = Callable[[RewardConfig], Any]  # a RewardConfig -> the Reward Service object it describes


class Scheduler(Protocol):
    def train_group(self, policy: PolicySpec) -> TrainWorker:
        """The policy's trainer: one worker, or the ranks of an FSDP2 group behind one client."""
        ...

    def rollout_pool(self, engine: EngineSpec, tokenizer: Any) -> RolloutPool:
        """The pool of ``scheduler.rollout.workers`` engines (engine i: ``engine.for_index(i)``)."""
        ...

    def critic_worker(self, critic: CriticSpec) -> Critic: ...

    def preference_trainer(self, spec: PreferenceSpec) -> PreferenceTrainer:
        """``postrl dpo``'s trainer (one worker: ``scheduler.train.workers`` must be 1)."""
        ...

    def reward_service(self, make: RewardFactory, reward: RewardConfig) -> RewardService: ...

    def experience_buffer(self, buffer: BufferConfig, seed: int) -> ExperienceStore: ...

    def teachers(self, spec: TeacherSpec) -> Teachers:
        """``algorithm.distill``'s teachers (a folder teacher computes where they are placed)."""
        ...

    def close(self) -> None: ...
