"""Golden 3-step runs of the paths the GRPO golden run does not pin: PPO's clipped loss over two
epochs (the clip fraction is above 0), PPO with a critic and whitened GAE, and DPO. Each stores the
loss and the key metrics of every step and a fingerprint of the final weights (1e-6, CPU float32).

Regenerate after an intended change (and say why in the commit):

    POSTRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_paths.py
"""

from __future__ import annotations

import json

import pytest

from postrl.cli import main
from tests.test_golden import check_golden
from tests.test_train_e2e import write_config

LENGTH_REWARD = {
    "components": [{"name": "len", "type": "custom", "function": "tests.reward_fns:length_score"}],
    "num_workers": 1,
}


@pytest.mark.slow
def test_ppo_clip_over_two_epochs_matches_golden_values(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        steps=3,
        seed=11,
        reward=LENGTH_REWARD,
        rollout={"n": 4, "max_tokens": 8},
        train={"lr": 3e-2, "epochs": 2, "mini_batch_size": 8, "micro_batch_size": 4},
        algorithm={"policy_loss": {"type": "ppo_clip", "clip_eps_low": 0.1, "clip_eps_high": 0.1}},
    )
    assert main(["train", config]) == 0
    keys = ["reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/clip_fraction", "actor/approx_kl"]
    # lr 3e-2 over two epochs amplifies float rounding: two CPU models (AVX-512 kernels of their own)
    # differed by 1.2e-5 relative at step 2, far below what any change to the loss moves
    rows = check_golden("ppo_clip_two_epochs", tmp_path / "runs" / "tiny", keys, rel=1e-4)
    assert max(r["actor/clip_fraction"] for r in rows) > 0  # the second epoch moves past the clip range


@pytest.mark.slow
def test_ppo_with_a_critic_and_whitened_gae_matches_golden_values(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        steps=3,
        seed=5,
        reward=LENGTH_REWARD,
        rollout={"n": 2, "max_tokens": 8},
        train={"lr": 1e-2, "mini_batch_size": 8, "micro_batch_size": 4},
        algorithm={"advantage": {"type": "gae", "lam": 0.9}, "critic": {"lr": 1e-2, "micro_batch_size": 4}},
    )
    assert main(["train", config]) == 0
    keys = ["reward/mean", "actor/loss", "actor/grad_norm", "actor/clip_fraction", "critic/value_loss"]
    check_golden("ppo_critic_gae", tmp_path / "runs" / "tiny", keys)


def test_dpo_matches_golden_values(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(10, 34)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "dpo.yaml"
    config.write_text(
        f"name: d\noutput_dir: {tmp_path}/runs\nseed: 3\nmodel: {{path: {tiny_model_dir}}}\n"
        f"data: {{train_files: [{data}]}}\ndpo: {{beta: 0.5}}\n"
        "train: {lr: 1.0e-2, mini_batch_size: 8, micro_batch_size: 4}\nepochs: 1\n"
        "checkpoint: {every_steps: 0}\nlogging: {trackers: [jsonl]}\n"
    )
    assert main(["dpo", str(config)]) == 0
    keys = ["dpo/loss", "dpo/reward_accuracy", "dpo/margin", "dpo/chosen_reward", "actor/grad_norm"]
    # lr 1e-2 moves each weight by about 3e-2 over the three steps; the sin-weighted fingerprint (a sum
    # with cancellation, -6.26) differed by 1.5e-6 relative between two CPU models' kernels, while a
    # change to the loss moves it by far more than 1e-5
    check_golden("dpo", tmp_path / "runs" / "d", keys, rel=1e-5)
