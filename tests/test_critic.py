"""PPO's critic: the clipped value loss by hand, values aligned with the response tokens, and a
run with GAE that checkpoints and resumes the critic."""

from __future__ import annotations

import json

import pytest
import torch

from postrl.config.algorithm import CriticConfig
from postrl.config.loading import build_config
from postrl.config.run import ConfigError
from postrl.train.critic import CriticWorker, clipped_value_loss
from postrl.types import Experience, ExperienceBatch


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 0.5]], dtype=torch.float64)
    old = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, clipped = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # token 0: v 1.0 -> clipped 0.7: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: v 0 -> 0.3: max(1, 0.49) = 1
    assert loss.tolist() == [pytest.approx([0.5 * 1.69, 0.5 * 1.0, 0.0])]
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]
    plain, _ = clipped_value_loss(values, old, returns, mask, clip=None)
    assert plain.tolist() == [pytest.approx([0.5, 0.5, 0.0])]


def test_values_cover_each_response_token_and_the_critic_learns(tiny_model_dir, char_tokenizer):
    critic = CriticWorker(
        CriticConfig(lr=1e-2, micro_batch_size=2), str(tiny_model_dir), "float32", char_tokenizer.pad_token_id
    )
    returns = [[1.0, 1.0, 1.0], [-1.0]]

    def batch(values: torch.Tensor | None = None) -> ExperienceBatch:
        rows = [([1, 20, 21], [30, 31, 2]), ([1, 22], [40])]
        exps = [Experience(p, r, [0.0] * len(r), 0.0, 0.0, 0, returns=ret) for (p, r), ret in zip(rows, returns)]
        b = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
        b.values = values
        return b

    values = critic.values(batch())
    assert values.shape == (2, 5) and values.abs().sum() == 0  # zero-initialised head
    first = critic.update(batch(values))["critic/value_loss"]
    for _ in range(30):
        last = critic.update(batch(critic.values(batch())))["critic/value_loss"]
    assert first == pytest.approx(0.5 * (3 * 1 + 1) / 4) and last < first / 4
    after = critic.values(batch())
    b = batch()
    assert (after * (1 - b.response_mask)).abs().sum() == 0  # 0 outside the response
    assert after[0, 2] > 0.3 and after[1, 1] < -0.3  # the first response token of each row


def test_gae_needs_a_critic_and_the_critic_needs_gae():
    with pytest.raises(ConfigError, match="algorithm.advantage=gae needs a critic"):
        build_config({"algorithm": {"advantage": "gae"}})
    with pytest.raises(ConfigError, match="algorithm.critic is only used by advantage=gae, not grpo"):
        build_config({"algorithm": {"critic": {"lr": 1e-4}}})


def test_ppo_run_trains_the_critic_checkpoints_and_resumes_it(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from postrl.run.checkpoint import latest_checkpoint
    from postrl.run.place import resume_config
    from postrl.run.train_runner import train

    config = build_config(
        {
            "name": "ppo",
            "output_dir": str(tmp_path),
            "steps": 2,
            "prompts_per_step": 4,
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_files": [str(arithmetic_jsonl)]},
            "rollout": {"n": 2, "max_tokens": 6},
            "reward": {
                "components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]
            },
            "algorithm": {"advantage": "gae", "critic": {"lr": 1e-2, "warmup_steps": 1}},
            "train": {"lr": 1e-2, "mini_batch_size": 8, "micro_batch_size": 8},
            "checkpoint": {"every_steps": 1},
            "logging": {"trackers": ["jsonl"]},
        }
    )
    controller = train(config).controller
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["critic/value_loss"] > 0 for r in rows)
    assert rows[0]["actor/grad_norm"] != rows[0]["actor/grad_norm"]  # NaN: step 1 is the critic's warm-up
    assert rows[1]["actor/grad_norm"] > 0
    assert controller.parts.critic.handle.obj.updates == 2
    checkpoint = latest_checkpoint(config.run_dir)
    assert (checkpoint / "critic" / "optimization.pt").is_file() and (checkpoint / "critic" / "dcp").is_dir()
    resumed = train(resume_config(config.run_dir, ["steps=3"]), resume=True).controller
    assert resumed.parts.critic.handle.obj.updates == 3  # 2 restored from the checkpoint + 1
    # the same 3 steps without a stop: the resumed critic's weights (and so its optimizer) match exactly
    straight = train(config.model_copy(update={"name": "straight", "steps": 3})).controller
    for (name, a), (_, b) in zip(
        resumed.parts.critic.handle.obj.model.state_dict().items(),
        straight.parts.critic.handle.obj.model.state_dict().items(),
    ):
        assert torch.equal(a, b), name
