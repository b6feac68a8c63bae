"""The local scheduler: one worker of a role lives in this process (called directly); several
workers of a role live in child processes (engines, or the ranks of an FSDP2 group)."""

from __future__ import annotations

from typing import Any

from postrl.buffer import ExperienceBuffer
from postrl.config.run import RunConfig
from postrl.models.devices import resolve_device
from postrl.rollout.host import ENGINE_SIDE_CALLS, RolloutEngineHost
from postrl.rollout.pool import RolloutPool
from postrl.scheduling.placement import make_pool
from postrl.train.factory import PolicySpec, build_train_worker
from postrl.train.group import TrainGroup
from postrl.train.rank import GroupSpec, TrainRank
from postrl.workers.clients import CriticClient, RewardServiceClient, TrainWorkerClient
from postrl.workers.handles import Handle, InProcessHandle
from postrl.workers.net import free_port
from postrl.workers.process import ProcessHandle


class LocalScheduler:
    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def rollout_pool(self, tokenizer: Any) -> RolloutPool:
        """One engine in this process, or several, each in a child process that takes new weights
        and a suspend beside the generate in progress (:data:`ENGINE_SIDE_CALLS`)."""
        c = self.config
        if c.scheduler.rollout.workers == 1:
            from postrl.rollout.factory import make_rollout_worker

            def start(i: int) -> Handle:
                engine = make_rollout_worker(
                    c.rollout, c.model.path, tokenizer, c.model.dtype, c.seed + i, c.model.synced_adapter_rank
                )
                return InProcessHandle(engine, f"rollout engine {i}", serialized=False)
        else:

            def start(i: int) -> Handle:
                return ProcessHandle(
                    f"rollout engine {i}",
                    RolloutEngineHost,
                    c.rollout,
                    c.model.path,
                    c.model.dtype,
                    c.seed + i,
                    c.scheduler.rollout.threads,
                    c.model.synced_adapter_rank,
                    side_calls=ENGINE_SIDE_CALLS,
                )

        return make_pool(c, start)

    def train_group(self, policy: PolicySpec | None = None) -> TrainWorkerClient | TrainGroup:
        """The trainer of ``policy`` (default: the run's policy): with one worker in this process,
        with several as the ranks of an FSDP2 group, each in its own process."""
        c = self.config
        n = c.scheduler.train.workers
        policy = policy or PolicySpec.of_run(c)
        if n == 1:
            worker = build_train_worker(policy, resolve_device(c.train.device, "train.device"))
            return TrainWorkerClient(InProcessHandle(worker, "train worker"))
        spec = GroupSpec(
            world=n, master_addr="127.0.0.1", master_port=free_port(), timeout_s=c.scheduler.call_timeout_s
        )
        ranks = [ProcessHandle(f"train rank {r}", TrainRank, r, spec, policy) for r in range(n)]
        return TrainGroup(ranks, call_timeout_s=c.scheduler.call_timeout_s)

    def critic_worker(self, pad_id: int) -> CriticClient:
        from postrl.train.critic import CriticWorker

        c = self.config
        if c.algorithm.critic is None:
            raise ValueError("a critic worker needs algorithm.critic")
        critic = CriticWorker(
            c.algorithm.critic, c.model.path, c.model.dtype, pad_id, seed=c.seed, device=c.train.device
        )
        return CriticClient(InProcessHandle(critic, "critic"))

    def reward_service(self, make: Any) -> RewardServiceClient:
        return RewardServiceClient(InProcessHandle(make(self.config.reward), "reward service"))

    def experience_buffer(self) -> ExperienceBuffer:
        b = self.config.buffer
        return ExperienceBuffer(b.max_staleness, b.on_stale, b.replay, seed=self.config.seed)

    def close(self) -> None:
        """Nothing to shut down beyond the workers, which the run closes."""
