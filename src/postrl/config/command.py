"""What every training command's config has (``postrl train``, ``sft``, ``dpo``): where the run
lives, its seed, the model, checkpoints and logging. Each command's config extends it with only
the sections it uses."""

from __future__ import annotations

from pydantic import Field

from postrl.config.base import Section
from postrl.config.location import RunLocation
from postrl.config.model import ModelConfig
from postrl.config.observability import LoggingConfig
from postrl.config.training import CheckpointConfig


class RunCommandConfig(RunLocation, Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Run folder name under output_dir.")
    output_dir: str = Field(
        "runs",
        description="Runs go to output_dir/name; a URL (s3://bucket/runs, file://...) "
        "keeps the run there through fsspec, working in a local copy.",
    )
    seed: int = Field(0, description="Seeds the data order and every generator of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="When checkpoints are written.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="What is logged, and where.")
