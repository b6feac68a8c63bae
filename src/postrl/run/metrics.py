"""Metric sinks: a compact console line per step, a JSONL file and TensorBoard event files."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Protocol

from postrl.types import StepMetrics
from postrl.types.metric_names import (
    ACCURACY,
    ACTOR_ENTROPY,
    ACTOR_GRAD_NORM,
    ACTOR_KL,
    DISTILL_REVERSE_KL,
    DPO_LOSS,
    DPO_MARGIN,
    DPO_REWARD_ACCURACY,
    PERF_GEN_TOKENS_PER_S,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
    REWARD_UNSCORABLE,
    ROLLOUT_LOGPROB_DIFF_MAX,
    SFT_LOSS,
    TIME_STEP_S,
    VAL_ACCURACY,
    VAL_REWARD_MEAN,
)

CONSOLE_KEYS = [
    (SFT_LOSS, "loss", "{:.4f}"),
    (REWARD_MEAN, "reward", "{:.3f}"),
    (ACCURACY, "acc", "{:.3f}"),
    (RESPONSE_LENGTH_MEAN, "len", "{:.1f}"),
    (ACTOR_KL, "kl", "{:.4f}"),
    (DISTILL_REVERSE_KL, "distill kl", "{:.4f}"),
    (ACTOR_ENTROPY, "ent", "{:.3f}"),
    (ACTOR_GRAD_NORM, "gnorm", "{:.3f}"),
    (PERF_GEN_TOKENS_PER_S, "tok/s", "{:.0f}"),
    (DPO_LOSS, "dpo loss", "{:.4f}"),
    (DPO_REWARD_ACCURACY, "pref acc", "{:.3f}"),
    (DPO_MARGIN, "margin", "{:.3f}"),
    (TIME_STEP_S, "s", "{:.1f}"),
]


# with rollout.exact: the largest difference between an engine's and the trainer's logprob of a token
EXACT_KEY = (ROLLOUT_LOGPROB_DIFF_MAX, "engine-trainer diff", "{:.3g}")


class MetricSink(Protocol):
    def write(self, metrics: StepMetrics) -> None: ...

    def close(self) -> None: ...


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def console_line(
    metrics: StepMetrics, total: int | None = None, policies: tuple[str, ...] = (), exact: bool = False
) -> str:
    """The step's line; with ``policies``, each policy's main metrics after its name; ``exact``
    (rollout.exact): the engine-trainer logprob difference too, which exact mode keeps at 0."""
    head = f"step {metrics.step}" + (f"/{total}" if total else "")
    if policies:
        return " || ".join([head, *(policy_part(metrics, name, exact) for name in policies)])
    return " | ".join([head, *metric_parts(metrics, exact)])


def policy_part(metrics: StepMetrics, name: str, exact: bool = False) -> str:
    """One policy's part of a step's line: its metrics are the step's ``NAME/...`` ones."""
    prefix = f"{name}/"
    values = {k[len(prefix) :]: v for k, v in metrics.values.items() if k.startswith(prefix)}
    notes = {k[len(prefix) :]: v for k, v in metrics.notes.items() if k.startswith(prefix)}
    own = StepMetrics(metrics.step, metrics.weight_version, values, notes)
    return " | ".join([name, *metric_parts(own, exact)])


def metric_parts(metrics: StepMetrics, exact: bool = False) -> list[str]:
    parts = []
    for key, label, fmt in [*CONSOLE_KEYS[:-1], *([EXACT_KEY] if exact else []), CONSOLE_KEYS[-1]]:
        value = metrics.values.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    if metrics.values.get(REWARD_UNSCORABLE, 0):
        note = metrics.notes.get("unscorable_reason")
        parts.append(
            f"unscorable {int(metrics.values[REWARD_UNSCORABLE])}" + (f" (most common: {note})" if note else "")
        )
    for key, label in ((VAL_ACCURACY, "val acc"), (VAL_REWARD_MEAN, "val reward")):
        if key in metrics.values:
            parts.append(f"{label} {metrics.values[key]:.3f}")
            break
    named = held_out_by_name(metrics.values)
    if named:
        parts.append("val " + ", ".join(f"{name} {value:.3f}" for name, value in named))
    for note in ("flagged", "no_signal", "no_samples"):
        if metrics.notes.get(note):
            parts.append(metrics.notes[note])
    return parts


def held_out_by_name(values: dict[str, float], most: int = 8) -> list[tuple[str, float]]:
    """The held-out accuracy of each task and each named eval set (``val/<name>/accuracy``), for the
    console line: the first ``most`` by name."""
    found = [
        (k[len("val/") : -len("/accuracy")], v)
        for k, v in values.items()
        if k.startswith("val/") and k.endswith("/accuracy") and k.count("/") == 2
    ]
    return sorted(found)[:most]


class ConsoleSink:
    """One line per step: ``step k/N``, the main metrics, time elapsed and an estimate of the time
    left (from this process's steps), the same on a terminal and in a log file."""

    def __init__(
        self,
        echo=print,
        total: int | None = None,
        clock=time.monotonic,
        policies: tuple[str, ...] = (),
        exact: bool = False,
    ) -> None:
        """``policies``: a run with several, whose metrics carry each policy's name; ``exact``: the
        run's rollout.exact (each line shows the engine-trainer difference)."""
        self.echo = echo
        self.total = total
        self.policies = policies
        self.exact = exact
        self.clock = clock
        self.started = clock()
        self.first_step: int | None = None

    def write(self, metrics: StepMetrics) -> None:
        line = console_line(metrics, self.total, self.policies, self.exact)
        if self.first_step is None:
            self.first_step = metrics.step - 1
        elapsed = self.clock() - self.started
        line += f" | {duration(elapsed)} elapsed"
        done = metrics.step - (self.first_step or 0)
        if self.total and done > 0 and metrics.step < self.total:
            line += f", ~{duration(elapsed / done * (self.total - metrics.step))} left"
        self.echo(line)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per step. On resume, lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        self.fh = path.open("a")

    def write(self, metrics: StepMetrics) -> None:
        row = {"step": metrics.step, "weight_version": metrics.weight_version, **metrics.values}
        self.fh.write(json.dumps(row, allow_nan=True) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def write(self, metrics: StepMetrics) -> None:
        for key, value in metrics.values.items():
            self.writer.add_scalar(key, value, metrics.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
