"""The roles of a run as Protocols: what the Controller calls, wherever the worker lives.

The Rollout Worker's own Protocol is :class:`postrl.rollout.base.RolloutWorker` (the engines
implement it); the others are here. A scheduler hands each role out as an object with these
methods: the worker itself in this process, or a typed client of its handle (a child process, a
Ray actor, an HTTP service).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from postrl.types import ExperienceBatch, RewardResult, ScoreRequest, TrainMetrics


class TrainWorker(Protocol):
    """PPO/GRPO/... updates; one process, or the ranks of an FSDP2 group behind one object."""

    def update(self, batch: ExperienceBatch) -> TrainMetrics: ...

    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """``[B, T-1]`` logprobs of the reference model (a KL needs one), 0 outside the response."""
        ...

    def set_kl_beta(self, beta: float) -> None: ...

    def policy_state(self) -> dict[str, torch.Tensor]: ...

    def save_pretrained(self, folder: str | Path) -> None: ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


class Critic(Protocol):
    """PPO's value model."""

    def values(self, batch: ExperienceBatch) -> torch.Tensor:
        """``[B, T-1]``: the value of every response position, 0 elsewhere."""
        ...

    def update(self, batch: ExperienceBatch) -> dict[str, float]:
        """Train towards the returns ``batch.advantages + batch.values``; the update's metrics."""
        ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


class RewardService(Protocol):
    """Scores (prompt, response) pairs: rules, sandboxed code tests, reward models, a mix."""

    accuracy_component: str | None  # the component whose value counts as correct for ``accuracy``

    def score_batch(self, requests: list[ScoreRequest]) -> list[RewardResult]: ...

    def error_count(self) -> int: ...

    def set_log_file(self, path: Path | None) -> None: ...

    def close(self) -> None: ...


class Scheduler(Protocol):
    """Places the workers of a run and hands out their roles."""

    def train_group(self, policy: Any = None) -> TrainWorker: ...

    def rollout_pool(self, tokenizer: Any) -> Any: ...

    def critic_worker(self, pad_id: int) -> Critic: ...

    def reward_service(self, make: Any) -> RewardService: ...

    def experience_buffer(self) -> Any: ...

    def close(self) -> None: ...
