"""End-to-end `postrl train` on a tiny random model built inside the test."""

from __future__ import annotations

import json

import yaml

from postrl.cli import main
from postrl.run.metrics import read_metrics


def write_config(tmp_path, model_dir, data_file, **extra) -> str:
    config = {
        "name": "tiny",
        "output_dir": str(tmp_path / "runs"),
        "seed": 1,
        "steps": 3,
        "prompts_per_step": 4,
        "model": {"path": str(model_dir)},
        "data": {"train_files": [str(data_file)]},
        "rollout": {"n": 4, "max_tokens": 8},
        "reward": {
            "components": [
                {"name": "verifiable", "type": "exact_match"},
                {"name": "format", "type": "format", "weight": 0.1},
            ],
            "num_workers": 1,
        },
        "train": {"lr": 1e-3, "mini_batch_size": 8, "micro_batch_size": 4},
        "checkpoint": {"every_steps": 2},
        "logging": {"progress_bar": False},
    }
    for key, value in extra.items():
        config[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_three_step_train_run(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    assert main(["train", config, "algorithm.kl_beta=0.05"]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    for key in [
        "reward/mean",
        "reward/std",
        "reward/min",
        "reward/max",
        "reward/unscorable",
        "accuracy",
        "response/length_mean",
        "response/length_max",
        "response/clip_ratio",
        "actor/kl",
        "actor/entropy",
        "actor/clip_fraction",
        "actor/grad_norm",
        "actor/lr",
        "perf/gen_tokens_per_s",
        "time/generate_s",
        "time/reward_s",
        "time/train_s",
        "time/sync_s",
        "reward/format/mean",
    ]:
        assert key in rows[-1], key
    assert rows[-1]["actor/kl"] >= 0.0
    sample = json.loads((run_dir / "samples" / "step_1.jsonl").read_text().splitlines()[0])
    assert sample["metadata"]["engine"] == "rollout engine 0" and sample["metadata"]["scored_at"] > 0
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["algorithm"]["kl_beta"] == 0.05
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002", "step_00000003"]
    assert json.loads((run_dir / "checkpoints" / "step_00000003" / "run_state.json").read_text())["step"] == 3
    assert "step 3" in capsys.readouterr().out
