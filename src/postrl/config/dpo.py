"""The config of ``postrl dpo``: offline preference training, sharing the model, train,
checkpoint and logging sections with ``postrl train``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from postrl.config.base import Section
from postrl.config.command import RunCommandConfig
from postrl.config.scheduler import SchedulerConfig
from postrl.config.training import OptimizerConfig


class PreferenceDataConfig(Section):
    train_files: list[str] = Field(
        min_length=1,
        description="JSONL or Parquet files of preference pairs: prompt, "
        "chosen, rejected strings, or chosen/rejected chat message lists.",
    )
    max_tokens: int = Field(512, ge=2, description="Longest prompt + completion; longer pairs are errors (or skipped).")
    on_bad_row: Literal["error", "skip"] = Field("error", description="Malformed or too-long rows: fail or skip.")
    apply_chat_template: bool = Field(
        False,
        description="Wrap a string prompt as one user message (chat template, generation prompt added), and "
        "its chosen and rejected strings as the assistant's answer; message lists always use the template.",
    )


class DPOConfig(Section):
    beta: float = Field(0.1, gt=0.0, description="Strength of the implicit KL to the reference (DPO's beta).")
    loss_type: Literal["sigmoid", "ipo", "cdpo"] = Field(
        "sigmoid",
        description="sigmoid: DPO; ipo: IPO's squared loss on per-token mean log-ratios; cdpo: "
        "DPO with label smoothing.",
    )
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="cdpo: the assumed rate of flipped labels.")


class DPORunConfig(RunCommandConfig):
    """``postrl dpo``: its ``train:`` section is the optimizer and batching only (the DPO update has
    no epochs over a mini-batch, no token-budget micro-batches and no bf16 autocast)."""

    name: str = Field("dpo", pattern=r"^[A-Za-z0-9_.-]+$", description="Run folder name under output_dir.")
    epochs: int = Field(1, ge=1, description="Passes over the pairs.")
    data: PreferenceDataConfig = Field(description="The preference pairs.")
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="The loss.")
    train: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(lr=5e-6, mini_batch_size=32, micro_batch_size=8),
        description="Optimizer and batching, in pairs (mini_batch_size pairs per step).",
    )
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description="Where the trainer runs: this process (type: local) or a Ray actor (type: ray, with "
        "scheduler.train's resources). DPO trains in one worker: scheduler.train.workers must be 1.",
    )

    @model_validator(mode="after")
    def _one_trainer(self) -> DPORunConfig:
        if self.scheduler.train.workers != 1:
            raise ValueError(
                f"scheduler.train.workers={self.scheduler.train.workers}: postrl dpo trains in one worker (set it to 1)"
            )
        return self
