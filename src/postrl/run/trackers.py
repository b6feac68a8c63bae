"""The experiment trackers teams already use: Weights & Biases and MLflow, as metric sinks.

Each gets the same scalars per step as metrics.jsonl, the resolved config as parameters at the
start, and at the end the final model and the plots as artifacts (``logging.artifacts``). A run
resumed later logs to the same tracker run (its id is kept in the run directory). A tracker that
fails mid-run (its server gone) warns once and is dropped; the run and metrics.jsonl go on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from postrl.run.metrics import MetricSink
from postrl.types import StepMetrics


def flat_params(tree: Any, prefix: str = "") -> dict[str, str]:
    """``{"train.lr": "1e-05", ...}``: a nested config as dotted keys and string values."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flat_params(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): str(tree)}


def finite(values: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def end_artifacts(run_dir: Path) -> tuple[Path | None, list[Path]]:
    """What a run leaves to upload at its end: final_model/ (when written) and its PNG plots."""
    model = run_dir / "final_model"
    return (model if model.is_dir() else None), sorted(run_dir.glob("*.png"))


def _run_id(run_dir: Path, name: str) -> str | None:
    path = run_dir / name
    return path.read_text().strip() if path.is_file() else None


class WandbSink:
    """A W&B run (online, or offline with ``WANDB_MODE=offline``: run_dir/wandb/offline-run-*)."""

    def __init__(self, config: Any, run_dir: Path) -> None:
        import wandb

        w = config.logging.wandb
        self.wandb = wandb
        self.run_dir = run_dir
        self.artifacts = config.logging.artifacts
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            tags=w.tags or None,
            name=config.name,
            dir=str(run_dir),
            config=config.model_dump(mode="json"),
            id=_run_id(run_dir, "wandb_run_id"),
            resume="allow",
        )
        (run_dir / "wandb_run_id").write_text(self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # a resumed run logs its steps again: no step order to break
        self.closed = False

    def write(self, metrics: StepMetrics) -> None:
        self.run.log({"step": metrics.step, "weight_version": metrics.weight_version, **finite(metrics.values)})

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        model, plots = end_artifacts(self.run_dir)
        if self.artifacts and (model is not None or plots):
            artifact = self.wandb.Artifact(f"{self.run.name}-outputs", type="model")
            if model is not None:
                artifact.add_dir(str(model), name="final_model")
            for plot in plots:
                artifact.add_file(str(plot), name=f"plots/{plot.name}")
            self.run.log_artifact(artifact)
        self.run.finish()


class MlflowSink:
    """An MLflow run at ``logging.mlflow.tracking_uri`` (default: run_dir/mlflow, a SQLite store)."""

    def __init__(self, config: Any, run_dir: Path) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        for chatty in ("mlflow.store.db.utils", "alembic.runtime.migration"):  # schema set-up notes on every start
            logging.getLogger(chatty).setLevel(logging.WARNING)

        m = config.logging.mlflow
        local = run_dir.resolve() / "mlflow"
        if m.tracking_uri is None:
            local.mkdir(parents=True, exist_ok=True)
        uri = m.tracking_uri or f"sqlite:///{local / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        self.run_dir = run_dir
        self.artifacts = config.logging.artifacts
        experiment = self.client.get_experiment_by_name(m.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            location = (local / "artifacts").as_uri() if m.tracking_uri is None else None
            experiment_id = self.client.create_experiment(m.experiment, artifact_location=location)
        run_id = _run_id(run_dir, "mlflow_run_id")
        self.run_id = run_id or self.client.create_run(experiment_id, run_name=config.name).info.run_id
        (run_dir / "mlflow_run_id").write_text(self.run_id)
        if run_id is None:
            params = [Param(k, v[:6000]) for k, v in flat_params(config.model_dump(mode="json")).items()]
            for start in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.closed = False

    def write(self, metrics: StepMetrics) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = {**finite(metrics.values), "weight_version": float(metrics.weight_version)}
        rows = [Metric(key, value, now, metrics.step) for key, value in values.items()]
        for start in range(0, len(rows), 1000):
            self.client.log_batch(self.run_id, metrics=rows[start : start + 1000])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        model, plots = end_artifacts(self.run_dir)
        if self.artifacts:
            if model is not None:
                self.client.log_artifacts(self.run_id, str(model), "final_model")
            for plot in plots:
                self.client.log_artifact(self.run_id, str(plot), "plots")
        self.client.set_terminated(self.run_id)


class GuardedSink:
    """A tracker that may fail mid-run: the first error is reported once and the tracker dropped."""

    def __init__(self, inner: MetricSink, name: str, echo: Callable[[str], None]) -> None:
        self.inner = inner
        self.name = name
        self.echo = echo
        self.failed = False

    def _guard(self, what: str, call: Callable[[], None]) -> None:
        if self.failed:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - any tracker failure: the run goes on without it
            self.failed = True
            self.echo(
                f"warning: the {self.name} tracker failed at {what} ({type(exc).__name__}: {exc}); the run goes on "
                "without it (metrics.jsonl and the other sinks have every step)"
            )

    def write(self, metrics: StepMetrics) -> None:
        self._guard(f"step {metrics.step}", lambda: self.inner.write(metrics))

    def close(self) -> None:
        self._guard("the end of the run", self.inner.close)


TRACKERS: dict[str, Callable[[Any, Path], MetricSink]] = {"wandb": WandbSink, "mlflow": MlflowSink}


def make_tracker(name: str, config: Any, run_dir: Path, echo: Callable[[str], None]) -> MetricSink:
    """A tracker sink, started now (a tracker that cannot start fails the run here, before the steps)."""
    try:
        sink = TRACKERS[name](config, run_dir)
    except Exception as exc:  # noqa: BLE001 - named and re-raised as a config problem
        from postrl.config.run import ConfigError

        raise ConfigError(f"logging.trackers: {name} could not start ({type(exc).__name__}: {exc})") from exc
    return GuardedSink(sink, name, echo)
