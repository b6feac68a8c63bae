"""What a run reports and where (console, metrics.jsonl, TensorBoard, trackers, a Prometheus
endpoint), and the memory check before it starts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from postrl.config.base import Section


class LoggingConfig(Section):
    console: bool = Field(True, description="One line of metrics per step on stdout.")
    progress_bar: bool = Field(True, description="A progress bar on a terminal (never when stderr is not a TTY).")
    jsonl: bool = Field(True, description="metrics.jsonl in the run directory.")
    tensorboard: bool = Field(True, description="TensorBoard event files under tensorboard/.")
    samples_first_steps: int = Field(
        3,
        ge=0,
        description="Write every sample of steps 1..k to samples/step_N.jsonl (prompt, response, reward, "
        "each component and its reason, error).",
    )
    samples_every: int = Field(10, ge=0, description="Also write the samples of every k-th step; 0 = never.")
    eval_every: int = Field(
        0,
        ge=0,
        description="Validate (data.val_files, or the task's test split) every k steps "
        "and after the last one, as val/* metrics in every sink and on the plot; 0 = never.",
    )


class PlanConfig(Section):
    check: Literal["warn", "refuse", "off"] = Field(
        "refuse",
        description="Before loading anything, postrl train compares the memory plan (postrl plan) with the free "
        "memory of the devices it sees: refuse a run that does not fit (naming the role, the figure and the fix), "
        "warn and run it, or skip the check. Ray runs are not checked (their GPUs are not visible here).",
    )
