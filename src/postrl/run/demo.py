"""``postrl demo``: GRPO on the built-in arithmetic task, from the shipped model, on a CPU.

Prints held-out accuracy before and after, saves the trained model with ``save_pretrained`` and
writes ``reward_accuracy.png`` (reward and accuracy per step) into the run directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from postrl.config.loading import build_config
from postrl.config.run import RunConfig
from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.run.evaluate import evaluate_model
from postrl.run.plots import plot_metrics
from postrl.run.train_runner import train

DEMO_SETTINGS: dict = {
    "name": "demo",
    "seed": 0,
    "steps": 100,
    "prompts_per_step": 32,
    "model": {"path": "demo"},
    "data": {"task": "arithmetic"},
    "rollout": {"n": 8, "temperature": 1.0, "max_tokens": 16},
    "reward": {"components": [{"name": "correct", "type": "exact_match"}], "num_workers": 1},
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

    before = evaluate_model(load_causal_lm(config.model.path), tokenizer, task, rollout=config.rollout)
    echo(f"held-out accuracy before GRPO: {before.accuracy:.3f} ({before.correct}/{before.total})")
    job = train(config)
    after = evaluate_model(load_causal_lm(str(config.run_dir / "final_model")), tokenizer, task, rollout=config.rollout)
    echo(f"held-out accuracy after  GRPO: {after.accuracy:.3f} ({after.correct}/{after.total})")
    plot = plot_metrics(config.run_dir, (before.accuracy, after.accuracy), "postrl demo: GRPO on 3-digit addition")
    echo(f"plot with held-out accuracy: {plot}")
    return DemoResult(config.run_dir, before.accuracy, after.accuracy, job.completed_steps, time.perf_counter() - start)
