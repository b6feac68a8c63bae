"""Golden values: a 3-step GRPO run of a tiny model with fixed seeds must reproduce the stored
loss, reward, KL, grad norm, entropy and final-weight fingerprint (1e-6 on CPU float32), so any change to
the math or to the data order fails here with the numbers that moved.

Regenerate after an intended change (and say why in the commit):

    POSTRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from postrl.cli import main
from postrl.run.metrics import read_metrics
from tests.test_train_e2e import write_config

GOLDEN = Path(__file__).parent / "golden" / "tiny_grpo.json"
KEYS = [
    "reward/mean",
    "actor/loss",
    "actor/kl",
    "actor/grad_norm",
    "actor/entropy",
    "actor/clip_fraction",
    "response/length_mean",
]


def fingerprint(folder: Path) -> dict[str, float]:
    state = load_file(str(folder / "model.safetensors"))
    flat = torch.cat([state[k].double().flatten() for k in sorted(state)])
    return {
        "sum": float(flat.sum()),
        "sum_sq": float((flat * flat).sum()),
        "weighted": float((flat * torch.arange(flat.numel(), dtype=torch.float64).sin()).sum()),
    }


def test_three_step_run_matches_golden_values(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        steps=3,
        seed=7,
        reward={
            "components": [{"name": "len", "type": "custom", "function": "tests.reward_fns:length_score"}],
            "num_workers": 1,
        },
        algorithm={"kl_beta": 0.05},
        rollout={"n": 4, "max_tokens": 8, "temperature": 1.0},
    )
    assert main(["train", config]) == 0
    check_golden("tiny_grpo", tmp_path / "runs" / "tiny", KEYS)


WEIGHTS_REL = 1e-5
"""The final-weight fingerprint's tolerance. Adam divides each gradient by its own running scale, so
a gradient that differs in its last bits between CPUs' float32 kernels (AVX2 against AVX-512
sums) moves a weight by a visible amount: 4.8e-6 of ppo_critic_gae's ``weighted`` on an AMD EPYC
against goldens written on an Intel Xeon. Three steps move that fingerprint by 1.79, so 1e-5
(8.5e-5 of it) still fails on a change of 1/20,000 of one run's training."""


def check_golden(name: str, run: Path, keys: list[str], rel: float = 1e-6) -> list[dict]:
    """The run's per-step ``keys`` against ``golden/NAME.json`` (``rel``, and 1e-6 absolute) and its
    final-weight fingerprint (``WEIGHTS_REL`` or ``rel``, whichever is looser); with
    ``POSTRL_UPDATE_GOLDEN=1`` they are written there first. Returns the run's metric rows."""
    rows = read_metrics(run / "metrics.jsonl")
    got = {"steps": [{k: row[k] for k in keys} for row in rows], "weights": fingerprint(run / "final_model")}
    path = GOLDEN.parent / f"{name}.json"
    if os.environ.get("POSTRL_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    assert len(got["steps"]) == len(want["steps"]) == 3
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"]), start=1):
        for key in keys:
            assert g[key] == pytest.approx(w[key], rel=rel, abs=1e-6), f"{name} step {step} {key}: {g[key]} != {w[key]}"
    for key, value in want["weights"].items():
        weights_rel = max(rel, WEIGHTS_REL)
        assert got["weights"][key] == pytest.approx(value, rel=weights_rel, abs=1e-6), f"{name} final weights {key}"
    return rows
