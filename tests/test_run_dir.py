"""Issue 8 items 1, 2, 5, 6: run directories are never mixed or clobbered, every run leaves
loadable models, signals stop a run cleanly, and configs that cannot work are refused early."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from postrl.cli import main
from postrl.run.metrics import read_metrics
from tests.test_reward_debugging import _worker_pids
from tests.test_train_e2e import write_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_second_run_into_same_directory_is_refused(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=2)
    assert main(["train", config]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    assert f"run directory {run_dir} already holds a run" in err
    assert f"postrl train --resume {run_dir}" in err and "name=NEW" in err and "--overwrite" in err
    # a launch that fails validation (a missing data file) writes nothing either
    assert main(["train", config, "data.train_files=[missing.jsonl]", "--overwrite"]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert main(["train", "--resume", str(run_dir), "steps=3"]) == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_overwrite_moves_the_old_run_aside(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=1)
    assert main(["train", config]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    (run_dir / "note.txt").write_text("mine")
    assert main(["train", config, "--overwrite", "steps=2"]) == 0
    aside = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("tiny.old-")]
    assert len(aside) == 1 and (aside[0] / "note.txt").read_text() == "mine"
    assert [r["step"] for r in read_metrics(aside[0] / "metrics.jsonl")] == [1]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]


def test_every_run_leaves_loadable_models(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=2)
    assert main(["train", config]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    final, checkpoint = run_dir / "final_model", run_dir / "checkpoints" / "step_00000002" / "model"
    for folder in (final, checkpoint):
        for name in (
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ):
            assert (folder / name).is_file(), folder / name
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert tok("12+3=")["input_ids"] and model.config.vocab_size == len(tok)
    assert (run_dir / "reward_accuracy.png").stat().st_size > 1000
    # a checkpoint's model folder is a valid model.path and a valid eval model
    capsys.readouterr()
    assert main(["train", config, "name=from-ckpt", f"model.path={checkpoint}", "steps=1"]) == 0
    assert main(["eval", "--model", str(checkpoint), "--task", "arithmetic", "--max-tokens", "4"]) == 0
    assert "arithmetic: held-out accuracy" in capsys.readouterr().out


def test_missing_model_path_is_one_line(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"postrl eval: error: no model folder at {tmp_path / 'nope'}, and {tmp_path / 'nope'} is not a model id"
    )
    start = time.monotonic()
    assert main(["eval", "--model", "surely-not-a-model-xyz"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and time.monotonic() - start < 20
    assert err.startswith(
        "postrl eval: error: no model folder at surely-not-a-model-xyz, and surely-not-a-model-xyz is not a model id"
    )
    (tmp_path / "empty").mkdir()
    assert main(["eval", "--model", str(tmp_path / "empty")]) == 2
    assert "is a folder but not a model folder (it has no config.json)" in capsys.readouterr().err


def test_eval_on_own_data_with_the_runs_rewards(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=1)
    assert main(["train", config]) == 0
    held_out = tmp_path / "heldout.jsonl"
    held_out.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    out = tmp_path / "scored.jsonl"
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "runs" / "tiny"), "--data", str(held_out), "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("heldout.jsonl: accuracy 0.000 (0/2), mean reward") and "unscorable 0" in line
    rows = [yaml.safe_load(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["1+1=", "2+2="]
    assert set(rows[0]["components"]) == {"verifiable", "format"}


def _train_subprocess(config: str, *extra: str, cwd=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen(
        [sys.executable, "-m", "postrl.cli", "train", config, *extra],
        cwd=cwd or REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"never saw {needle!r}: {seen}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.slow
def test_signal_stops_after_the_step_and_checkpoints(tmp_path, tiny_model_dir, arithmetic_jsonl, sig):
    config = write_config(
        tmp_path, tiny_model_dir, arithmetic_jsonl, steps=200, checkpoint={"every_steps": 0, "keep_last": 1}
    )
    proc = _train_subprocess(config)
    _wait_for_line(proc, "step 2/")
    assert len(_worker_pids(proc.pid)) >= 1
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert _worker_pids(proc.pid) == []  # no scoring worker outlives the trainer
    run_dir = tmp_path / "runs" / "tiny"
    last = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    assert 2 <= last < 200
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{last:08d}"]
    assert (
        f"stopped after step {last}; the last checkpoint is step {last}. Resume with: postrl train --resume {run_dir}"
        in err
    )

    proc = _train_subprocess("--resume", str(run_dir), f"steps={last + 1}")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"resumed {run_dir} from step {last}" in err
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, last + 2))


def test_group_estimator_with_one_sample_is_refused(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    assert main(["train", config, "rollout.n=1"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.advantage=grpo compares the samples of a prompt, so it needs rollout.n >= 2 (got 1" in err
    assert not (tmp_path / "runs").exists()


def test_context_length_is_checked_before_any_work(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    assert main(["train", config, "data.max_prompt_tokens=100", "rollout.max_tokens=40"]) == 2
    err = capsys.readouterr().err
    assert "data.max_prompt_tokens=100 + rollout.max_tokens=40 = 140 is more than the model's context length 128" in err
    assert main(["train", config, "rollout.max_tokens=128"]) == 2
    assert (
        "rollout.max_tokens=128 leaves no room for a prompt in the model's context length 128"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "runs").exists()


def test_jsonl_errors_name_the_right_column_and_skipped_rows_are_listed(tmp_path, tiny_model_dir, capsys):
    rows = [f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}' for i in range(100)]
    bad = '{"prompt": "100+1=", "answer": "101",, "x": 1}'
    assert bad.index(",,") + 2 == 38  # the second comma is the 38th character
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(rows + [bad, '{"answer": "3"}']) + "\n")
    config = write_config(tmp_path, tiny_model_dir, data)
    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    assert f"{data}:101: invalid JSON at column 38: Expecting property name enclosed in double quotes" in err
    assert main(["train", config, "data.on_bad_row=skip", "steps=1"]) == 0
    captured = capsys.readouterr().err
    assert "skipped 2 bad rows (data.on_bad_row=skip):" in captured
    assert f"  {data}:101: invalid JSON at column 38" in captured
    assert f"  {data}:102: row has neither 'prompt' nor 'messages'" in captured
    listed = (tmp_path / "runs" / "tiny" / "skipped_rows.txt").read_text().splitlines()
    assert [x.split(": ")[0] for x in listed] == [f"{data}:101", f"{data}:102"]


@pytest.mark.slow
def test_second_signal_abandons_the_step_and_keeps_the_last_completed_one(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        steps=200,
        checkpoint={"every_steps": 0, "keep_last": 1},
        reward={
            "components": [{"name": "slow", "type": "custom", "function": "tests.reward_fns:slow_length"}],
            "num_workers": 2,
        },
    )
    proc = _train_subprocess(config)
    _wait_for_line(proc, "step 1/")
    time.sleep(0.3)  # inside step 2's scoring, which takes ~1.6 s
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT again: abandoning the current step" in err and "Traceback" not in err
    run_dir = tmp_path / "runs" / "tiny"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]
    assert f"stopped after step 1; the last checkpoint is step 1. Resume with: postrl train --resume {run_dir}" in err
    assert _worker_pids(proc.pid) == []
