"""The reward/accuracy PNG drawn at the end of every run (and, with held-out points, by the demo)."""

from __future__ import annotations

import math
from pathlib import Path

from postrl.run.metrics import read_metrics
from postrl.types.metric_names import ACCURACY, REWARD_MEAN, VAL_ACCURACY, VAL_REWARD_MEAN


def policy_prefixes(rows: list[dict]) -> list[str]:
    """The key prefix of each policy a run's metrics are about: ``""`` for a run of one policy, each
    ``NAME/`` for a run of several (their keys are ``alice/reward/mean``, ...)."""
    if any(REWARD_MEAN in r for r in rows):
        return [""]
    tail = "/" + REWARD_MEAN
    return sorted({k[: -len(REWARD_MEAN)] for r in rows for k in r if k.endswith(tail)})


def plot_metrics(run_dir: Path, held_out: tuple[float, float] | None = None, title: str | None = None) -> Path | None:
    """``run_dir/reward_accuracy.png`` from ``metrics.jsonl`` (a line per policy of a run of several);
    None when there is nothing to draw."""
    path = run_dir / "metrics.jsonl"
    every = read_metrics(path) if path.is_file() else []
    series = {}
    for prefix in policy_prefixes(every):  # a step with every sample unscorable has no reward
        rows = [r for r in every if math.isfinite(r.get(prefix + REWARD_MEAN, math.nan))]
        if rows:
            series[prefix] = rows
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for prefix, rows in series.items():
        _draw(ax, rows, prefix)
    if held_out is not None:
        last = max(r["step"] for rows in series.values() for r in rows)
        ax.scatter([0, last], list(held_out), color="black", zorder=3, label="held-out accuracy (greedy)")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 1.5 on a short run's axis
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or f"postrl: {run_dir.name}")
    out = run_dir / "reward_accuracy.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _draw(ax, rows: list[dict], prefix: str) -> None:
    """One policy's lines: its reward, its accuracy, its validation accuracy (or reward)."""
    who = f"{prefix[:-1]}: " if prefix else ""
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r[prefix + REWARD_MEAN] for r in rows], label=f"{who}reward (train batch mean)")
    if all(prefix + ACCURACY in r for r in rows):
        ax.plot(steps, [r[prefix + ACCURACY] for r in rows], "--", label=f"{who}accuracy (train batch)")
    for key, label in ((VAL_ACCURACY, "validation accuracy (greedy)"), (VAL_REWARD_MEAN, "validation reward")):
        val = [r for r in rows if prefix + key in r]
        if val:
            ax.plot([r["step"] for r in val], [r[prefix + key] for r in val], "o-", label=who + label)
            break
