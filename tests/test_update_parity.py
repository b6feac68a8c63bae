"""postrl's GRPO update is TRL's: the aggregations' gradients and the GRPO advantage by hand (float64),
and one whole update against TRL's GRPOTrainer (benchmarks/update_parity.py; skipped, saying why,
where TRL is not installed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from postrl.algorithms import ADVANTAGES, LOSS_AGGREGATIONS, AdvantageInputs, LossNormalizer
from tests.test_algorithms import MASK, PER_TOKEN

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# d loss / d per_token, by hand: rows of 3, 1 and 2 trained tokens; 6 tokens, 3 sequences, a budget of 4
GRADIENTS_BY_HAND = {
    "token_mean": [[1 / 6] * 3, [1 / 6, 0, 0], [1 / 6, 1 / 6, 0]],  # TRL dapo (and bnpo, one micro-batch)
    "seq_mean_token_mean": [[1 / 9] * 3, [1 / 3, 0, 0], [1 / 6, 1 / 6, 0]],  # TRL grpo: 1 / (3 x the row's tokens)
    "seq_mean_token_sum": [[1 / 3] * 3, [1 / 3, 0, 0], [1 / 3, 1 / 3, 0]],
    "seq_mean_token_sum_norm": [[1 / 12] * 3, [1 / 12, 0, 0], [1 / 12, 1 / 12, 0]],  # TRL dr_grpo: 1 / (3 x 4)
}


@pytest.mark.parametrize("name", sorted(GRADIENTS_BY_HAND))
def test_aggregation_gradient_by_hand(name):
    per_token = torch.tensor(PER_TOKEN, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    norm = LossNormalizer(tokens=mask.sum(), sequences=torch.tensor(3.0, dtype=torch.float64), max_tokens=4)
    (grad,) = torch.autograd.grad(LOSS_AGGREGATIONS.get(name)(per_token, mask, norm), per_token)
    expected = torch.tensor(GRADIENTS_BY_HAND[name], dtype=torch.float64)
    assert torch.allclose(grad, expected, rtol=0, atol=1e-15), grad


def test_grpo_advantage_is_trls_with_its_eps():
    """TRL: (r - mean) / (nanstd + 1e-4), nanstd Bessel-corrected; an unscorable (None/NaN) reward
    is out of its group's mean and std. Group [1, 0, 0, 1]: std sqrt(1/3); group [1, NaN, 0.5, 0]:
    mean 0.5, std 0.5."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, float("nan"), 0.5, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = ADVANTAGES.get("grpo")(AdvantageInputs(rewards, groups), eps=1e-4)
    a = 0.5 / (3**-0.5 + 1e-4)  # 0.866025 without the eps
    b = 0.5 / (0.5 + 1e-4)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, b, 0.0, 0.0, -b], abs=1e-7)
    unscaled = ADVANTAGES.get("grpo")(AdvantageInputs(rewards, groups), norm_by_std=False)
    assert unscaled.tolist() == [0.5, -0.5, -0.5, 0.5, 0.5, 0.0, 0.0, -0.5]


@pytest.fixture(scope="module")
def update_parity():
    if importlib.util.find_spec("trl") is None:
        reason = "TRL is not installed (pip install -e '.[bench]'): the TRL comparison cannot run"
        print(reason)
        pytest.skip(reason)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import update_parity
    finally:
        sys.path.remove(str(BENCHMARKS))
    return update_parity


@pytest.mark.slow
def test_one_update_equals_trls_for_every_loss_type_and_reward_scaling(update_parity):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = update_parity.run(smoke=False)
        wrong = update_parity.control()
    finally:
        torch.set_num_threads(threads)
    assert {key.split("/")[0] for key in rows} == {"grpo", "bnpo", "dr_grpo", "dapo"}
    assert {key.split("/")[1] for key in rows} == {"group", "none"}
    for key, row in rows.items():
        assert row["loss_rel_diff"] <= 1e-5, (key, row)
        assert row["grad_rel_diff"] <= 1e-5 and row["grad_cosine"] >= 0.99999, (key, row)
        assert row["weights_rel_diff"] <= 1e-5, (key, row)
        assert row["grad_norm_postrl"] == pytest.approx(row["grad_norm_trl"], rel=1e-5)
    # the comparison tells a different aggregation apart: its bounds are not met by any update
    assert wrong["grad_rel_diff"] > 0.1 and wrong["loss_rel_diff"] > 1e-3


def test_the_share_of_an_update_a_bf16_copy_carries(char_tokenizer):
    """An AdamW step moves each entry by about lr. At lr 1e-9 only entries within 1e-9 of a rounding
    boundary (weights near 0, whose bf16 step is as small) move their bf16 value; at lr 0.1 every
    entry's moves (1.0); in between the share grows with the lr, and at lr 1e-6 (the ~0.02 weights'
    bf16 step is ~1e-4) most of the update stays in the master weights."""
    from postrl.config.run import AlgorithmConfig, TrainConfig
    from postrl.train.worker import PolicyTrainer
    from postrl.types.metric_names import TRAIN_UPDATE_VISIBLE_BF16
    from tests.conftest import make_tiny_model
    from tests.test_train_worker import batch_of

    shares = []
    for lr in (1e-9, 1e-6, 1e-4, 1e-1):
        model = make_tiny_model("llama", char_tokenizer).float()
        trainer = PolicyTrainer(model, TrainConfig(lr=lr, mini_batch_size=2, micro_batch_size=2), AlgorithmConfig())
        shares.append(trainer.update(batch_of(char_tokenizer, [1.0, -1.0])).values[TRAIN_UPDATE_VISIBLE_BF16])
    assert shares[0] < 0.005 and shares[-1] == 1.0, shares
    assert shares[0] < shares[1] < 0.5 < shares[2] < 1.0, shares
    # bf16 master weights have no rounding to measure against: the metric is left out, not written as 0 or 1
    model = make_tiny_model("llama", char_tokenizer).to(torch.bfloat16)
    trainer = PolicyTrainer(model, TrainConfig(lr=1e-3, mini_batch_size=2, micro_batch_size=2), AlgorithmConfig())
    assert TRAIN_UPDATE_VISIBLE_BF16 not in trainer.update(batch_of(char_tokenizer, [1.0, -1.0])).values
