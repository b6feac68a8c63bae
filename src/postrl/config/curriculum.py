"""How a leveled task's difficulty follows its recent training accuracy (``curriculum:`` of a
generated-problems data source)."""

from __future__ import annotations

from pydantic import Field, model_validator

from postrl.config.base import Section


class CurriculumConfig(Section):
    raise_at: float = Field(
        0.7, gt=0.0, le=1.0, description="A task's recent training accuracy at or above this raises its level."
    )
    lower_at: float = Field(0.2, ge=0.0, lt=1.0, description="At or below this (and above level 0) lowers it.")
    window: int = Field(
        64, ge=1, description="Training samples of a task its recent accuracy is over; emptied when its level moves."
    )

    @model_validator(mode="after")
    def _ordered(self) -> CurriculumConfig:
        if self.lower_at >= self.raise_at:
            raise ValueError(f"lower_at={self.lower_at} must be below raise_at={self.raise_at}")
        return self
