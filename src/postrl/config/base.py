"""The base of every config section: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"  # a device name: auto, cpu, cuda or cuda:N


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
