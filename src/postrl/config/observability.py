"""What a run reports and where (console, metrics.jsonl, TensorBoard, trackers, a Prometheus
endpoint), and the memory check before it starts."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from postrl.config.base import Section

Tracker = Literal["tensorboard", "jsonl", "wandb", "mlflow"]
# the module a tracker imports, and the extra that installs it
DEFAULT_TRACKERS: tuple[Tracker, ...] = ("tensorboard", "jsonl")
TRACKER_PACKAGES = {"wandb": ("wandb", "postrl[wandb]"), "mlflow": ("mlflow", "postrl[mlflow]")}


class PrometheusConfig(Section):
    host: str = Field(
        "127.0.0.1", description="Bind address of the /metrics and /health endpoint; loopback by default."
    )
    port: int = Field(9400, ge=0, le=65535, description="Port to listen on (0: any free port, printed at the start).")


class WandbConfig(Section):
    project: str = Field("postrl", min_length=1, description="The W&B project runs are logged to.")
    entity: str | None = Field(None, description="The W&B entity (user or team); None: the account's default.")
    tags: list[str] = Field(default_factory=list, description="Tags on the W&B run.")


class MlflowConfig(Section):
    tracking_uri: str | None = Field(
        None,
        description="Any MLflow tracking URI (http://host:5000, databricks, sqlite:///...). None: a local store in "
        "the run directory, mlflow/ (its mlflow.db and artifacts/; `mlflow ui --backend-store-uri "
        "sqlite:///RUN/mlflow/mlflow.db` shows it).",
    )
    experiment: str = Field("postrl", min_length=1, description="The MLflow experiment runs are logged to.")


class LoggingConfig(Section):
    console: bool = Field(True, description="One line of metrics per step on stdout.")
    progress_bar: bool = Field(True, description="A progress bar on a terminal (never when stderr is not a TTY).")
    progress: bool = Field(
        True,
        description="Progress of a step's phases that run longer than 5 s (a batch's generation or episodes, the "
        "update, a teacher pass, an evaluation): done / total, tokens/s and the time left, on the progress bar "
        "(else in place on one line of stderr) where stderr is a terminal; where it is not (a log file), a line "
        "every 30 s and one when the phase ends.",
    )
    trackers: list[Tracker] = Field(
        default_factory=lambda: list(DEFAULT_TRACKERS),
        description="Where each step's scalars go besides the console: tensorboard (tensorboard/), jsonl "
        "(metrics.jsonl, which postrl report and resume read), wandb (online, or offline with WANDB_MODE=offline; "
        "pip install 'postrl[wandb]'), mlflow (pip install 'postrl[mlflow]'). W&B and MLflow also get the resolved "
        "config as parameters and, at the end, the final model and the plots as artifacts; one that fails mid-run "
        "warns once and the run goes on.",
    )
    artifacts: bool = Field(True, description="Upload final_model/ and the plots to W&B / MLflow at the end.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="logging.trackers: wandb's settings.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="logging.trackers: mlflow's settings.")
    prometheus: PrometheusConfig | None = Field(
        None,
        description="Serve Prometheus metrics (/metrics: step phases, throughput, reward, KL, sync, engines, "
        "buffer, memory; docs/observability.md) and /health from the run's process; None: no endpoint.",
    )
    stall_after_s: float = Field(
        1800.0,
        gt=0.0,
        description="/health answers 503 when no step has finished for this many seconds (the first step counted "
        "from the start).",
    )
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

    @field_validator("trackers")
    @classmethod
    def _trackers_installed(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError(f"logging.trackers lists a tracker twice: {trackers}")
        for name in trackers:
            if name in TRACKER_PACKAGES:
                module, extra = TRACKER_PACKAGES[name]
                if importlib.util.find_spec(module) is None:
                    raise ValueError(f"logging.trackers: {name} needs the {module} package: pip install '{extra}'")
        return trackers


class PlanConfig(Section):
    check: Literal["warn", "refuse", "off"] = Field(
        "refuse",
        description="Before loading anything, postrl train compares the memory plan (postrl plan) with the free "
        "memory of the devices it sees: refuse a run that does not fit (naming the role, the figure and the fix), "
        "warn and run it, or skip the check. Ray runs are not checked (their GPUs are not visible here).",
    )
