"""``postrl demo``: GRPO on the built-in arithmetic task, from the shipped model, on a CPU.

Prints held-out accuracy before and after, saves the trained model with ``save_pretrained`` and
writes ``reward_accuracy.png`` (reward and accuracy per step) into the run directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


from postrl.config import RunConfig, build_config
from postrl.evaluate import evaluate_model
from postrl.metrics import read_metrics
from postrl.models import load_causal_lm, load_tokenizer
from postrl.runner import train

DEMO_SETTINGS: dict = {
    "name": "demo",
    "seed": 0,
    "steps": 100,
    "prompts_per_step": 32,
    "model": {"path": "demo"},
    "data": {"task": "arithmetic"},
    "rollout": {"n": 8, "temperature": 1.0, "max_tokens": 16},
    "reward": {"verifiable": {"type": "exact_match"}, "num_workers": 1},
    "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "kl_beta": 0.0},
    "train": {"lr": 1e-4, "mini_batch_size": 128, "micro_batch_size": 128, "epochs": 1, "warmup_steps": 2},
    "checkpoint": {"every_steps": 0, "keep_last": 1},
}


@dataclass
class DemoResult:
    run_dir: Path
    acc_before: float
    acc_after: float
    steps: int
    wall_s: float


def unique_run_name(output_dir: str, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``... so an earlier demo run is never overwritten."""
    candidate, i = name, 1
    while (Path(output_dir) / candidate).exists():
        i += 1
        candidate = f"{name}-{i}"
    return candidate


def demo_config(overrides: list[str] | None = None) -> RunConfig:
    config = build_config(DEMO_SETTINGS, overrides)
    config.name = unique_run_name(config.output_dir, config.name)
    return config


def run_demo(overrides: list[str] | None = None, echo=print) -> DemoResult:
    start = time.perf_counter()
    config = demo_config(overrides)
    tokenizer = load_tokenizer(config.model.path)
    task = config.data.task or "arithmetic"

    before = evaluate_model(load_causal_lm(config.model.path), tokenizer, task)
    echo(f"held-out accuracy before GRPO: {before.accuracy:.3f} ({before.correct}/{before.total})")
    controller = train(config)
    policy = controller.parts.trainer.model
    after = evaluate_model(policy, tokenizer, task)
    echo(f"held-out accuracy after  GRPO: {after.accuracy:.3f} ({after.correct}/{after.total})")

    final = config.run_dir / "final_model"
    policy.save_pretrained(final, safe_serialization=True)
    tokenizer.save_pretrained(final)
    plot = plot_metrics(config.run_dir, before.accuracy, after.accuracy)
    echo(f"trained model: {final}\nplot: {plot}")
    return DemoResult(config.run_dir, before.accuracy, after.accuracy, controller.step_count, time.perf_counter() - start)


def plot_metrics(run_dir: Path, acc_before: float, acc_after: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward/mean"] for r in rows], label="reward (train batch mean)")
    if all("accuracy" in r for r in rows):
        ax.plot(steps, [r["accuracy"] for r in rows], "--", label="accuracy (train batch)")
    ax.scatter([0, steps[-1]], [acc_before, acc_after], color="black", zorder=3, label="held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("postrl demo: GRPO on 3-digit addition")
    out = run_dir / "reward_accuracy.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
