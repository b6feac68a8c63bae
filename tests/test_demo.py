"""`postrl demo` and `postrl eval` on the shipped model (a few steps; learning is benchmarked)."""

from __future__ import annotations

import re

import pytest
from transformers import AutoModelForCausalLM

from postrl.cli import main
from postrl.reward.verifiers import exact_match
from postrl.tasks.arithmetic import ArithmeticProblem, make_splits


def test_task_splits_are_disjoint_and_seeded():
    train, test = make_splits(seed=0, n_train=500, n_test=50)
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in test}
    assert make_splits(seed=0, n_train=500, n_test=50)[1] == test
    p = ArithmeticProblem(347, 285)
    assert p.answer == 632 and p.carry_dropped_answer() == 522
    # the task is scored by the exact_match verifier (its reference is the row's `answer`)
    row = p.to_row()
    columns = {k: v for k, v in row.items() if k != "prompt"}  # what the reward sees, as for a dataset row
    assert exact_match(row["prompt"], "<answer>632</answer>", **columns) == 1.0
    assert exact_match(row["prompt"], "<answer>522</answer>", **columns) == 0.0


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", f"output_dir={tmp_path}", "steps=2", "prompts_per_step=4", "logging.progress_bar=false"]) == 0
    out = capsys.readouterr().out
    before = float(re.search(r"accuracy before GRPO: ([0-9.]+)", out).group(1))
    assert before <= 0.5  # the shipped model keeps the format but is often wrong
    run = tmp_path / "demo"
    assert (run / "reward_accuracy.png").stat().st_size > 10_000
    assert (run / "metrics.jsonl").is_file() and (run / "config.yaml").is_file()
    AutoModelForCausalLM.from_pretrained(run / "final_model")
    # a second demo never overwrites the first
    assert main(["demo", f"output_dir={tmp_path}", "steps=1", "prompts_per_step=2", "logging.progress_bar=false"]) == 0
    assert (tmp_path / "demo-2" / "final_model").is_dir()


def test_eval_prints_held_out_accuracy(capsys):
    assert main(["eval", "--model", "demo", "--task", "arithmetic"]) == 0
    assert re.search(r"arithmetic: held-out accuracy 0\.\d+ \(\d+/200\)", capsys.readouterr().out)
