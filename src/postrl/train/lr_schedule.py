"""Learning-rate schedules: a pure function of the optimizer step, wrapped as a LambdaLR.

Warm-up is linear to ``lr`` over ``warmup_steps`` optimizer steps; then ``constant`` keeps it,
``linear`` and ``cosine`` decay it to ``min_lr_ratio * lr`` at ``decay_steps`` (counted from the
first optimizer step, warm-up included) and hold it there. The scheduler's step count is part of
the Train Worker's checkpoint, so a resumed run continues the same curve.
"""

from __future__ import annotations

import math
from functools import partial

import torch


def lr_factor(step: int, schedule: str, warmup_steps: int, decay_steps: int | None, min_lr_ratio: float) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or not decay_steps:
        return 1.0
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def make_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, decay_steps: int | None, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    if schedule != "constant" and not decay_steps:
        raise ValueError(f"train.lr_schedule={schedule} needs train.lr_decay_steps (the run sets it from its length)")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(
            lr_factor, schedule=schedule, warmup_steps=warmup_steps, decay_steps=decay_steps, min_lr_ratio=min_lr_ratio
        ),
    )
