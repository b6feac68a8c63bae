"""The KL to the reference: the adaptive coefficient by hand, the KL as a per-token penalty in the
reward, and the coefficient carried through a run."""

from __future__ import annotations

import json

import pytest

from postrl.algorithms.kl_control import adaptive_kl_coef
from postrl.config.loading import build_config
from postrl.config.run import ConfigError


def test_adaptive_kl_coefficient_by_hand():
    # observed 0.15 vs target 0.1: error clipped to +0.2; 128 samples over a horizon of 1000
    assert adaptive_kl_coef(0.05, 0.15, 0.1, 128, 1000) == pytest.approx(0.05 * (1 + 0.2 * 0.128))
    # observed 0.09: error -0.1
    assert adaptive_kl_coef(0.05, 0.09, 0.1, 100, 1000) == pytest.approx(0.05 * (1 - 0.1 * 0.1))
    assert adaptive_kl_coef(0.05, float("nan"), 0.1, 100, 1000) == 0.05


def test_kl_settings_are_checked():
    with pytest.raises(ConfigError, match="kl_target adapts kl_beta from its starting value"):
        build_config({"algorithm": {"kl_target": 0.1}})
    with pytest.raises(
        ConfigError, match="kl_in=reward puts a per-token penalty into the rewards, which advantage=grpo does not take"
    ):
        build_config({"algorithm": {"kl_in": "reward", "kl_beta": 0.1}})
    with pytest.raises(ConfigError, match="kl_in=reward puts -kl_beta x KL in the reward: set kl_beta > 0"):
        build_config({"algorithm": {"kl_in": "reward", "advantage": "reinforce_pp"}})


def run(tmp_path, model_dir, data, algorithm, name):
    from postrl.run.train_runner import train

    config = build_config(
        {
            "name": name,
            "output_dir": str(tmp_path),
            "steps": 2,
            "prompts_per_step": 4,
            "model": {"path": str(model_dir)},
            "data": {"train_files": [str(data)]},
            "rollout": {"n": 4, "max_tokens": 6},
            "reward": {
                "components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]
            },
            "algorithm": algorithm,
            "train": {"lr": 5e-2, "mini_batch_size": 16, "micro_batch_size": 8},
            "checkpoint": {"every_steps": 1},
            "logging": {"trackers": ["jsonl"]},
        }
    )
    controller = train(config).controller
    return controller, [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_kl_penalty_in_the_reward_grows_once_the_policy_moves(tmp_path, tiny_model_dir, arithmetic_jsonl):
    _, rows = run(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        {"advantage": "reinforce_pp", "kl_in": "reward", "kl_beta": 0.1},
        "kl-reward",
    )
    assert rows[0]["kl/reward_penalty"] < 1e-5  # step 1: the policy is the reference
    assert rows[1]["kl/reward_penalty"] > 1e-4  # after one update it is not
    assert rows[0]["actor/kl"] == 0.0  # not in the loss as well


def test_adaptive_kl_coefficient_follows_the_observed_kl_and_resumes(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from postrl.run.place import resume_config
    from postrl.run.train_runner import train

    controller, rows = run(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        {"kl_beta": 0.1, "kl_target": 0.01, "kl_horizon": 100},
        "kl-adaptive",
    )
    beta = 0.1
    for row in rows:  # the coefficient after each step, from that step's observed KL
        beta = adaptive_kl_coef(beta, row["actor/kl"], 0.01, 16, 100)
        assert row["actor/kl_beta"] == pytest.approx(beta)
    assert rows[-1]["actor/kl_beta"] != 0.1 and controller.parts.trainer.handle.obj.kl_beta == pytest.approx(beta)
    resumed = train(resume_config(tmp_path / "kl-adaptive", ["steps=2"]), resume=True).controller
    assert resumed.kl.beta == pytest.approx(beta) and resumed.parts.trainer.handle.obj.kl_beta == pytest.approx(beta)
