"""Exact resume, and a checkpoint interrupted mid-write leaving the previous one usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from postrl.cli import main
from postrl.run.checkpoint import latest_checkpoint, list_checkpoints
from postrl.run.metrics import read_metrics
from tests.test_train_e2e import write_config

SIGNAL = ["reward.components=[{name: length, type: custom, function: 'tests.reward_fns:length_score'}]"]
COMPARED = ["reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "response/length_mean"]


def final_weights(run_dir):
    return load_file(str(latest_checkpoint(run_dir) / "model" / "model.safetensors"))


def test_resumed_run_is_bit_identical(tmp_path, tiny_model_dir, arithmetic_jsonl):
    (tmp_path / "a").mkdir()
    straight = write_config(tmp_path / "a", tiny_model_dir, arithmetic_jsonl)
    assert main(["train", straight, "steps=4", "checkpoint.every_steps=2", "rollout.temperature=1.2", *SIGNAL]) == 0

    (tmp_path / "b").mkdir()
    interrupted = write_config(tmp_path / "b", tiny_model_dir, arithmetic_jsonl)
    assert main(["train", interrupted, "steps=2", "checkpoint.every_steps=2", "rollout.temperature=1.2", *SIGNAL]) == 0
    run_b = tmp_path / "b" / "runs" / "tiny"
    assert main(["train", "--resume", str(run_b), "steps=4"]) == 0

    run_a = tmp_path / "a" / "runs" / "tiny"
    rows_a, rows_b = read_metrics(run_a / "metrics.jsonl"), read_metrics(run_b / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        for key in COMPARED:
            assert ra[key] == rb[key], (ra["step"], key)
    wa, wb = final_weights(run_a), final_weights(run_b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # an uninterrupted run with another seed differs, so the comparison above is meaningful
    (tmp_path / "c").mkdir()
    other = write_config(tmp_path / "c", tiny_model_dir, arithmetic_jsonl)
    assert main(["train", other, "steps=2", "seed=2", "rollout.temperature=1.2", *SIGNAL]) == 0
    rows_c = read_metrics(tmp_path / "c" / "runs" / "tiny" / "metrics.jsonl")
    assert rows_a[0]["actor/grad_norm"] > 0
    assert any(rows_c[i]["actor/loss"] != rows_a[i]["actor/loss"] for i in range(2))


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    assert main(["train", config, "steps=1", "checkpoint.every_steps=5"]) == 0
    run = tmp_path / "runs" / "tiny"
    for ckpt in list_checkpoints(run):
        (ckpt / "COMPLETE").unlink()
    assert main(["train", "--resume", str(run)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from postrl.run.checkpoint import save_checkpoint

    class SlowTrainer:
        def save_checkpoint(self, path):
            path.mkdir(parents=True)
            (path / "optimizer.pt").write_bytes(b"partial")
            print("writing", flush=True)
            time.sleep(60)

    save_checkpoint(Path(sys.argv[1]), 5, SlowTrainer(), {"step": 5})
    """
)


@pytest.mark.slow
def test_process_killed_while_checkpointing_leaves_previous_checkpoint(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    assert main(["train", config, "steps=2", "checkpoint.every_steps=2"]) == 0
    run = tmp_path / "runs" / "tiny"
    before = latest_checkpoint(run)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run / "checkpoints" / ".step_00000005.tmp").exists()
    assert latest_checkpoint(run) == before
    assert main(["train", "--resume", str(run), "steps=3"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
