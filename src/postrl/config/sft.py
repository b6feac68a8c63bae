"""The config of ``postrl sft``: supervised fine-tuning, sharing the model, train, checkpoint,
logging and scheduler sections with ``postrl train``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from postrl.config.base import Section
from postrl.config.command import RunCommandConfig
from postrl.config.scheduler import SchedulerConfig
from postrl.config.training import PolicyTrainConfig


class SFTDataConfig(Section):
    train_files: list[str] = Field(
        min_length=1,
        description="JSONL or Parquet files: prompt and response strings, "
        "or a chat message list (its assistant turns are trained).",
    )
    prompt_column: str = Field("prompt", description="Column holding the prompt string.")
    response_column: str = Field("response", description="Column holding the target response string.")
    messages_column: str = Field("messages", description="Column holding a chat message list.")
    apply_chat_template: bool = Field(False, description="Wrap prompt strings as one user message (chat template).")
    max_tokens: int = Field(
        512, ge=2, description="Longest example (prompt + response); longer rows are errors (or skipped)."
    )
    on_bad_row: Literal["error", "skip"] = Field("error", description="Malformed or too-long rows: fail or skip.")


class SFTRunConfig(RunCommandConfig):
    """``postrl sft``."""

    name: str = Field("sft", pattern=r"^[A-Za-z0-9_.-]+$", description="Run folder name under output_dir.")
    import_paths: list[str] = Field(
        default_factory=list,
        description="Folders put on the import path (the config's folder is added when it is loaded).",
    )
    epochs: int = Field(1, ge=1, description="Passes over the examples.")
    data: SFTDataConfig = Field(description="The examples.")
    train: PolicyTrainConfig = Field(
        default_factory=lambda: PolicyTrainConfig(lr=1e-4, mini_batch_size=32, micro_batch_size=8),
        description="Optimizer and batching, in examples (mini_batch_size per step); the loss "
        "is the mean negative log-likelihood over the trained tokens.",
    )
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description="Where the train ranks run: "
        "scheduler.train.workers > 1 is an FSDP2 group; type: ray places them as "
        "Ray actors.",
    )
