"""The local scheduler: one worker of a role lives in this process (called directly); several
workers of a role live in child processes (engines, or the ranks of an FSDP2 group)."""

from __future__ import annotations

from typing import Any

from postrl.config.run import RunConfig
from postrl.rollout.host import RolloutEngineHost
from postrl.rollout.pool import RolloutPool
from postrl.scheduling.placement import make_pool
from postrl.train.group import TrainGroup
from postrl.train.rank import GroupSpec, PolicySpec, TrainRank
from postrl.workers.handles import InProcessHandle
from postrl.workers.net import free_port
from postrl.workers.process import ProcessHandle


def policy_spec(config: RunConfig) -> PolicySpec:
    return PolicySpec(
        config.model.path,
        config.model.dtype,
        config.train,
        config.algorithm,
        temperature=config.rollout.temperature,
        seed=config.seed,
        gradient_checkpointing=config.model.gradient_checkpointing,
        max_response_tokens=config.rollout.max_tokens,
    )


class LocalScheduler:
    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def rollout_pool(self, tokenizer: Any) -> RolloutPool:
        c = self.config
        if c.scheduler.rollout.workers == 1:
            from postrl.rollout.factory import make_rollout_worker

            def start(i: int) -> InProcessHandle:
                engine = make_rollout_worker(c.rollout, c.model.path, tokenizer, c.model.dtype, c.seed + i)
                return InProcessHandle(engine, f"rollout engine {i}")
        else:

            def start(i: int) -> ProcessHandle:
                return ProcessHandle(
                    f"rollout engine {i}",
                    RolloutEngineHost,
                    c.rollout,
                    c.model.path,
                    c.model.dtype,
                    c.seed + i,
                    c.scheduler.rollout.threads,
                )

        return make_pool(c, start)

    def train_group(self, policy: PolicySpec | None = None) -> TrainGroup:
        """The train ranks, each in its own process, building ``policy`` (default: the run's policy)."""
        c = self.config
        n = c.scheduler.train.workers
        spec = GroupSpec(
            world=n, master_addr="127.0.0.1", master_port=free_port(), timeout_s=c.scheduler.call_timeout_s
        )
        policy = policy or policy_spec(c)
        ranks = [ProcessHandle(f"train rank {r}", TrainRank, r, spec, policy) for r in range(n)]
        return TrainGroup(ranks, call_timeout_s=c.scheduler.call_timeout_s)

    def critic_worker(self, pad_id: int) -> Any:
        from postrl.train.critic import CriticWorker

        c = self.config
        return CriticWorker(c.algorithm.critic, c.model.path, c.model.dtype, pad_id, seed=c.seed, device=c.train.device)

    def reward_service(self, make: Any) -> Any:
        return make(self.config.reward)

    def close(self) -> None:
        """Nothing to shut down beyond the workers, which the run closes."""
