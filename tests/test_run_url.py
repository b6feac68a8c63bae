"""A run directory at a URL (fsspec; file:// here, s3:// and the like with their extra): the run
publishes its state there, a new run refuses it, and a resume on a machine without the local copy
continues from the published checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest

from postrl.config.loading import build_config
from postrl.run.place import RunDirectoryError, resume_config
from postrl.run.train_runner import train


def url_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=2):
    return build_config(
        {
            "name": "remote",
            "output_dir": f"file://{tmp_path}/bucket/runs",
            "steps": steps,
            "prompts_per_step": 4,
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_files": [str(arithmetic_jsonl)]},
            "rollout": {"n": 4, "max_tokens": 8},
            "reward": {
                "components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]
            },
            "train": {"lr": 1e-2, "mini_batch_size": 16, "micro_batch_size": 8},
            "checkpoint": {"every_steps": 1, "keep_last": 1},
            "logging": {"trackers": ["jsonl"]},
        }
    )


def test_url_run_publishes_refuses_a_second_new_run_and_resumes_elsewhere(
    tmp_path, tiny_model_dir, arithmetic_jsonl, monkeypatch
):
    monkeypatch.setenv("POSTRL_RUN_CACHE", str(tmp_path / "cache"))
    config = url_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    assert config.run_url == f"file://{tmp_path}/bucket/runs/remote"
    assert config.run_dir.parent == tmp_path / "cache"
    train(config)
    remote = tmp_path / "bucket" / "runs" / "remote"
    assert (remote / "config.yaml").is_file() and (remote / "final_model" / "model.safetensors").is_file()
    assert sorted(p.name for p in (remote / "checkpoints").iterdir()) == ["step_00000002"]  # keep_last=1 there too
    assert (remote / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert not (remote / "controller.lease").exists()  # released at the end
    assert [json.loads(line)["step"] for line in (remote / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    with pytest.raises(RunDirectoryError, match=f"run directory file://{tmp_path}/bucket/runs/remote already holds"):
        train(url_config(tmp_path, tiny_model_dir, arithmetic_jsonl))

    shutil.rmtree(tmp_path / "cache")  # another machine: no local copy
    resumed = train(resume_config(config.run_url, ["steps=3"]), resume=True).controller
    assert resumed.step_count == 3
    assert [json.loads(line)["step"] for line in (remote / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in (remote / "checkpoints").iterdir()) == ["step_00000003"]
