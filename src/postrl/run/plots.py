"""The reward/accuracy PNG drawn at the end of every run (and, with held-out points, by the demo)."""

from __future__ import annotations

import math
from pathlib import Path

from postrl.run.metrics import read_metrics
from postrl.types.metric_names import ACCURACY, REWARD_MEAN, VAL_ACCURACY, VAL_REWARD_MEAN


def plot_metrics(run_dir: Path, held_out: tuple[float, float] | None = None, title: str | None = None) -> Path | None:
    """``run_dir/reward_accuracy.png`` from ``metrics.jsonl``; None when there is nothing to draw."""
    path = run_dir / "metrics.jsonl"
    rows = [r for r in read_metrics(path) if REWARD_MEAN in r] if path.is_file() else []
    rows = [r for r in rows if math.isfinite(r[REWARD_MEAN])]  # a step with every sample unscorable has none
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r[REWARD_MEAN] for r in rows], label="reward (train batch mean)")
    if all(ACCURACY in r for r in rows):
        ax.plot(steps, [r[ACCURACY] for r in rows], "--", label="accuracy (train batch)")
    for key, label in ((VAL_ACCURACY, "validation accuracy (greedy)"), (VAL_REWARD_MEAN, "validation reward")):
        val = [r for r in rows if key in r]
        if val:
            ax.plot([r["step"] for r in val], [r[key] for r in val], "o-", label=label)
            break
    if held_out is not None:
        ax.scatter([0, steps[-1]], list(held_out), color="black", zorder=3, label="held-out accuracy (greedy)")
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
