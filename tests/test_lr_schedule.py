"""Learning-rate schedules: hand-computed factors, the run's length as the default horizon, and a
resumed run continuing the same curve."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.cli import main
from postrl.run.metrics import read_metrics
from postrl.train.lr_schedule import lr_factor, make_scheduler
from tests.test_train_e2e import write_config


def test_factors_by_hand():
    # warm-up 2 of 10 steps, then decay over the 8 left to a floor of 0.1
    assert [lr_factor(s, "constant", 2, 10, 0.1) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, "linear", 2, 10, 0.1) == 1.0
    assert lr_factor(6, "linear", 2, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(10, "linear", 2, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(50, "linear", 2, 10, 0.1) == pytest.approx(0.1)  # held past the horizon
    assert lr_factor(6, "cosine", 2, 10, 0.0) == pytest.approx(0.5)
    assert lr_factor(4, "cosine", 2, 10, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(1, "cosine", 0, 5, 0.2) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 5)))


def test_the_scheduler_follows_the_factors_and_needs_a_horizon():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = make_scheduler(opt, "linear", 0, 4, 0.0)
    seen = []
    for _ in range(5):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="train.lr_schedule=cosine needs train.lr_decay_steps"):
        make_scheduler(opt, "cosine", 0, None, 0.0)


@pytest.mark.slow
def test_a_cosine_run_decays_over_its_length_and_resumes_on_the_curve(tmp_path, tiny_model_dir, arithmetic_jsonl):
    # 4 steps x (4 prompts x 4 samples / mini-batch 8) = 8 optimizer steps; lr 1e-3 -> 1e-4
    schedule = ["train.lr_schedule=cosine", "train.min_lr_ratio=0.1", "checkpoint.every_steps=2"]
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=4)
    assert main(["train", config, *schedule]) == 0
    run = tmp_path / "runs" / "tiny"
    assert "lr_decay_steps: 8" in (run / "config.yaml").read_text()
    full = [r["actor/lr"] for r in read_metrics(run / "metrics.jsonl")]
    # actor/lr is read after each step's 2 optimizer steps
    assert full == pytest.approx([1e-3 * lr_factor(s, "cosine", 0, 8, 0.1) for s in (2, 4, 6, 8)])
    # stopped after step 2 and resumed: the same curve
    (tmp_path / "b").mkdir()
    config2 = write_config(tmp_path / "b", tiny_model_dir, arithmetic_jsonl, steps=4)
    assert main(["train", config2, *schedule, "steps=2", "train.lr_decay_steps=8"]) == 0
    resumed_run = tmp_path / "b" / "runs" / "tiny"
    assert main(["train", "--resume", str(resumed_run), "steps=4"]) == 0
    assert [r["actor/lr"] for r in read_metrics(resumed_run / "metrics.jsonl")] == pytest.approx(full)
