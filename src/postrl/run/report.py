"""``postrl report RUN [RUN ...]``: the curves users check first, one PNG, runs overlaid.

Reads each run's metrics.jsonl (a run folder, or the file itself); a panel is drawn when any run
has its metric, and a run without it is left out of that panel's legend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from postrl.config.run import ConfigError
from postrl.types.metric_names import (
    ACCURACY,
    ACTOR_APPROX_KL,
    ACTOR_CLIP_FRACTION,
    ACTOR_ENTROPY,
    ACTOR_GRAD_NORM,
    ACTOR_KL,
    PERF_GEN_TOKENS_PER_S,
    PERF_TRAIN_TOKENS_PER_S,
    RESPONSE_CLIP_RATIO,
    RESPONSE_LENGTH_MAX,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
    TIME_GENERATE_S,
    TIME_REWARD_S,
    TIME_STEP_S,
    TIME_SYNC_S,
    TIME_TRAIN_S,
    VAL_ACCURACY,
)

# (title, [(metric key, line label)], y label)
PANELS: list[tuple[str, list[tuple[str, str]], str]] = [
    (
        "reward and accuracy",
        [(REWARD_MEAN, "reward"), (ACCURACY, ACCURACY), (VAL_ACCURACY, "val accuracy")],
        "",
    ),
    ("KL to the reference", [(ACTOR_KL, "kl"), (ACTOR_APPROX_KL, "approx kl (old policy)")], ""),
    ("entropy", [(ACTOR_ENTROPY, "entropy")], "nats/token"),
    ("response length", [(RESPONSE_LENGTH_MEAN, "mean"), (RESPONSE_LENGTH_MAX, "max")], "tokens"),
    ("truncated responses", [(RESPONSE_CLIP_RATIO, "cut at max_tokens")], "fraction"),
    ("clip fraction", [(ACTOR_CLIP_FRACTION, "clipped ratio")], "fraction of tokens"),
    ("grad norm", [(ACTOR_GRAD_NORM, "before clipping")], ""),
    (
        "phase seconds",
        [
            (TIME_GENERATE_S, "generate"),
            (TIME_REWARD_S, "reward"),
            (TIME_TRAIN_S, "train"),
            (TIME_SYNC_S, "sync"),
            (TIME_STEP_S, "step"),
        ],
        "s",
    ),
    ("throughput", [(PERF_GEN_TOKENS_PER_S, "generated"), (PERF_TRAIN_TOKENS_PER_S, "trained")], "tokens/s"),
]
STYLES: list = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]


@dataclass
class RunMetrics:
    name: str
    rows: list[dict]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.rows if isinstance(r.get(key), (int, float))]
        return [s for s, _ in points], [float(v) for _, v in points]


def load_run(path: str) -> RunMetrics:
    """A run folder's (or a file's) metrics; a bad line is named by file and line."""
    given = Path(path).expanduser()
    file = given / "metrics.jsonl" if given.is_dir() else given
    if not file.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl (give a run folder such as runs/NAME, or its metrics.jsonl)")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}:{number}: invalid JSON at column {exc.colno}") from None
        if not isinstance(row, dict) or "step" not in row:
            raise ConfigError(f"{file}:{number}: a metrics line needs a step")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{file}: no steps yet")
    name = file.parent.name if file.name == "metrics.jsonl" else file.stem
    return RunMetrics(name, rows)


def unique_names(runs: list[RunMetrics], paths: list[str]) -> None:
    """Two runs of the same name (runs/a/x and runs/b/x) are told apart by their parent folder."""
    names = [r.name for r in runs]
    for run, path in zip(runs, paths):
        if names.count(run.name) > 1:
            folder = Path(path).expanduser().resolve()
            folder = folder if folder.is_dir() else folder.parent
            run.name = f"{folder.parent.name}/{folder.name}"


def panels_for(runs: list[RunMetrics]) -> list[tuple[str, list[tuple[str, str]], str]]:
    """The panels (and their lines) some run has data for."""
    panels = [(t, [(k, lab) for k, lab in keys if any(r.series(k)[0] for r in runs)], y) for t, keys, y in PANELS]
    return [p for p in panels if p[1]] + per_task_panels(runs)


def per_task_panels(runs: list[RunMetrics]) -> list[tuple[str, list[tuple[str, str]], str]]:
    """Held-out accuracy per eval set and per task (``val/<...>/accuracy``), training accuracy per
    task (``accuracy/<task>``) and curriculum levels, for the keys some run has."""
    keys = sorted({k for r in runs for row in r.rows for k in row if isinstance(row[k], (int, float))})
    held_out = [
        (k, k[len("val/") : -len("/accuracy")])
        for k in keys
        if k.startswith("val/") and k.endswith("/accuracy") and k != VAL_ACCURACY
    ]
    trained = [(k, k[len("accuracy/") :]) for k in keys if k.startswith("accuracy/")]
    levels = [(k, k.split("/")[1]) for k in keys if k.startswith("curriculum/") and k.endswith("/level")]
    panels = [
        ("held-out accuracy by set and task", held_out, ""),
        ("training accuracy by task", trained, ""),
        ("curriculum level", levels, "level"),
    ]
    return [p for p in panels if p[1]]


def write_report(paths: list[str], out: Path) -> Path:
    """Draw the panels that any run has data for into ``out`` (PNG)."""
    runs = [load_run(p) for p in paths]
    unique_names(runs, paths)
    panels = panels_for(runs)
    if not panels:
        raise ConfigError(f"{', '.join(paths)}: none of the reported metrics is in these runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys, ylabel) in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            for j, (key, label) in enumerate(keys):
                steps, values = run.series(key)
                if steps:
                    name = run.name if len(keys) == 1 else f"{run.name}: {label}"
                    ax.plot(steps, values, linestyle=STYLES[j % len(STYLES)], color=colors[i % len(colors)], label=name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("postrl report: " + ", ".join(r.name for r in runs))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
