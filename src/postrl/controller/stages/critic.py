"""PPO's critic in the step: its values before advantages, its update after the policy's."""

from __future__ import annotations

import threading

from postrl.controller.stages.base import Phase, Stage
from postrl.types import ExperienceBatch, StepBatch, TrainMetrics
from postrl.workers.roles import Critic


class CriticStage(Stage):
    """``prepare`` sets ``step.batch.values`` (the critic's value of every response position, which GAE
    reads); ``after_update`` trains the critic towards the returns (advantage + value at rollout
    time). For the first ``warmup_steps`` steps the policy waits while the critic learns values
    worth a baseline."""

    name = "critic"
    phases = ("prepare", "after_update")
    needs = frozenset({"critic"})

    def __init__(self, critic: Critic, warmup_steps: int) -> None:
        self.critic = critic
        self.warmup_steps = warmup_steps
        self._lock = threading.Lock()  # async mode: values (producer) never read a critic mid-update

    def prepare(self, step: StepBatch) -> dict[str, float]:
        with self._lock:
            step.batch.values = self.critic.values(step.batch)
        return {}

    def after_update(self, batch: ExperienceBatch, train: TrainMetrics) -> dict[str, float]:
        with self._lock:
            return self.critic.update(batch)

    def timer_name(self, phase: Phase) -> str:
        return "critic" if phase == "after_update" else "values"

    def policy_waits(self, completed_steps: int) -> bool:
        return completed_steps < self.warmup_steps
