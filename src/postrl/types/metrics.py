"""What an update and a step report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from postrl.types.metric_names import (
    ACTOR_ENTROPY,
    ACTOR_GRAD_NORM,
    ACTOR_KL,
    ACTOR_LOSS,
    ACTOR_LR,
    ACTOR_SKIPPED_UPDATES,
    ROLLOUT_MISMATCH_KL,
)


@dataclass
class TrainMetrics:
    """One update's metrics by name (``actor/loss``, ``actor/clip_fraction``, ``rollout/mismatch_kl``
    ...: what the loss and the trainer reported, reduced once) and the optimizer's counters."""

    values: dict[str, float]
    optimizer_steps: int
    skipped_steps: int

    def get(self, name: str) -> float:
        """A metric's value; NaN when this update did not report it."""
        return self.values.get(name, math.nan)

    @staticmethod
    def skipped() -> TrainMetrics:
        """A step whose policy update did not run (the critic's warm-up): NaN metrics, no step."""
        nan = math.nan
        names = (ACTOR_LOSS, ACTOR_KL, ACTOR_ENTROPY, ACTOR_GRAD_NORM, ACTOR_LR, ROLLOUT_MISMATCH_KL)
        return TrainMetrics({**{name: nan for name in names}, ACTOR_SKIPPED_UPDATES: 0.0}, 0, 0)


@dataclass
class StepMetrics:
    step: int
    weight_version: int
    values: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)  # text for the console, e.g. the top unscorable reason
