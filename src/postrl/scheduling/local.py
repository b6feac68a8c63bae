"""The local scheduler: one worker of a role lives in this process (called directly); several
workers of a role live in child processes (engines, or the ranks of an FSDP2 group)."""

from __future__ import annotations

from typing import Any

from postrl.buffer import ExperienceBuffer
from postrl.config.off_policy import BufferConfig
from postrl.config.run import RewardConfig
from postrl.config.scheduler import SchedulerConfig
from postrl.models.devices import resolve_device
from postrl.rollout.factory import EngineSpec
from postrl.rollout.host import ENGINE_SIDE_CALLS, RolloutEngineHost
from postrl.rollout.pool import RolloutPool
from postrl.scheduling.base import RewardFactory
from postrl.scheduling.placement import make_pool
from postrl.train.critic import CriticSpec
from postrl.train.dpo import PreferenceSpec
from postrl.train.factory import PolicySpec, build_train_worker
from postrl.train.group import TrainGroup
from postrl.train.rank import GroupSpec, TrainRank
from postrl.train.teachers.teachers import TeacherSpec
from postrl.workers.clients import RewardServiceClient, client
from postrl.workers.handles import Handle, InProcessHandle
from postrl.workers.net import free_port
from postrl.workers.process import ProcessHandle
from postrl.workers.roles import Critic, ExperienceStore, PreferenceTrainer, Teachers, TrainWorker


class LocalScheduler:
    def __init__(self, scheduler: SchedulerConfig) -> None:
        self.scheduler = scheduler

    def rollout_pool(self, engine: EngineSpec, tokenizer: Any) -> RolloutPool:
        """One engine in this process, or several, each in a child process that takes new weights
        and a suspend beside the generate in progress (:data:`ENGINE_SIDE_CALLS`)."""
        s = self.scheduler
        if s.rollout.workers == 1:

            def start(i: int) -> Handle:
                built = engine.for_index(i).build(tokenizer)
                return InProcessHandle(built, f"rollout engine {i}", serialized=False)
        else:

            def start(i: int) -> Handle:
                spec = engine.for_index(i, s.rollout.threads)
                return ProcessHandle(f"rollout engine {i}", RolloutEngineHost, spec, side_calls=ENGINE_SIDE_CALLS)

        return make_pool(engine.rollout, s, start)

    def train_group(self, policy: PolicySpec) -> TrainWorker:
        """The trainer of ``policy``: with one worker in this process, with several as the ranks of
        an FSDP2 group, each in its own process."""
        n, timeout = self.scheduler.train.workers, self.scheduler.call_timeout_s
        if n == 1:
            worker = build_train_worker(policy, resolve_device(policy.train.device, "train.device"))
            return client(InProcessHandle(worker, "train worker"), TrainWorker)
        group = GroupSpec(world=n, master_addr="127.0.0.1", master_port=free_port(), timeout_s=timeout)
        ranks = [ProcessHandle(f"train rank {r}", TrainRank, r, group, policy) for r in range(n)]
        return client(TrainGroup(ranks, call_timeout_s=timeout), TrainWorker)

    def critic_worker(self, critic: CriticSpec) -> Critic:
        return client(InProcessHandle(critic.build(), "critic"), Critic)

    def preference_trainer(self, spec: PreferenceSpec) -> PreferenceTrainer:
        return client(InProcessHandle(spec.build(), "dpo trainer"), PreferenceTrainer)

    def reward_service(self, make: RewardFactory, reward: RewardConfig) -> RewardServiceClient:
        return RewardServiceClient(InProcessHandle(make(reward), "reward service"))

    def experience_buffer(self, buffer: BufferConfig, seed: int) -> ExperienceStore:
        """The buffer in this process; it orders its own calls (the producer's puts beside the consumer's gets)."""
        store = ExperienceBuffer(buffer.max_staleness, buffer.on_stale, buffer.replay, seed=seed)
        return client(InProcessHandle(store, "experience buffer", serialized=False), ExperienceStore)

    def teachers(self, spec: TeacherSpec) -> Teachers:
        """In this process, a folder teacher on ``train.device``."""
        return client(InProcessHandle(spec.build(), "teachers"), Teachers)

    def close(self) -> None:
        """Nothing to shut down beyond the workers, which the run closes."""
