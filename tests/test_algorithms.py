"""Advantage estimators and policy losses against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.algorithms import (
    ADVANTAGES,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    AdvantageInputs,
    LossInputs,
    LossNormalizer,
    kl_k3,
)
from postrl.algorithms.registry import Registry

NAN = float("nan")


def grpo(rewards, groups, **kw):
    return ADVANTAGES.get("grpo")(AdvantageInputs(torch.tensor(rewards), torch.tensor(groups)), **kw)


def test_grpo_advantage_by_hand():
    adv = grpo([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    # mean 0.5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.8660
    expected = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([expected, -expected, -expected, expected]), atol=1e-5)


def test_unit_advantage_is_one_for_every_scored_sample_whatever_its_reward():
    """SFT's estimator: REINFORCE with advantage 1 is the negative log-likelihood."""
    adv = ADVANTAGES.get("unit")(AdvantageInputs(torch.tensor([1.0, 0.0, NAN, -3.0]), torch.tensor([0, 0, 1, 1])))
    assert adv.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert not ADVANTAGES.needs("unit").groups


def test_grpo_equal_rewards_single_sample_and_unscorable():
    adv = grpo([1.0, 1.0, 0.3, 1.0, NAN, 0.0], [0, 0, 1, 2, 2, 2])
    assert adv[0] == 0 and adv[1] == 0  # all equal -> no signal
    assert adv[2] == 0  # a single-sample group has no baseline
    # group 2: NaN left out, scorable [1, 0] -> mean 0.5, std sqrt(0.5)
    assert adv[3].item() == pytest.approx(0.5 / math.sqrt(0.5), abs=1e-5)
    assert adv[4].item() == 0.0
    assert adv[5].item() == pytest.approx(-0.5 / math.sqrt(0.5), abs=1e-5)
    assert not torch.isnan(adv).any()


def test_grpo_without_std_normalisation():
    adv = grpo([2.0, 0.0, 1.0], [0, 0, 0], norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def ppo_inputs(ratios, advantages, mask=None):
    ratios = torch.tensor(ratios, dtype=torch.float64)
    old = torch.zeros_like(ratios)
    logp = torch.log(ratios).requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else torch.tensor(mask, dtype=torch.float64)
    return logp, LossInputs(logp, old, torch.tensor(advantages, dtype=torch.float64), mask)


def test_ppo_clip_by_hand_both_sides():
    logp, inputs = ppo_inputs([[1.5, 0.5, 1.0, 1.1], [1.5, 0.5, 1.0, 1.1]], [1.0, -1.0])
    out = POLICY_LOSSES.get("ppo_clip")(inputs)
    expected = torch.tensor([[-1.2, -0.5, -1.0, -1.1], [1.5, 0.8, 1.0, 1.1]], dtype=torch.float64)
    assert torch.allclose(out.per_token, expected)
    # A>0 clips above 1+eps; A<0 clips below 1-eps
    assert out.metrics["actor/clip_fraction"].per_token.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0]]
    out.per_token.sum().backward()
    grad = logp.grad
    assert grad[0, 0] == 0 and grad[1, 1] == 0  # no gradient through the clipped branch
    assert grad[0, 1].item() == pytest.approx(-0.5)  # d(-r*A)/dlogp = -r*A
    assert grad[1, 0].item() == pytest.approx(1.5)


def test_ppo_empty_response_gives_zero_loss_without_nan():
    logp, inputs = ppo_inputs([[1.0, 1.0]], [2.0], mask=[[0.0, 0.0]])
    out = POLICY_LOSSES.get("ppo_clip")(inputs)
    for name in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        loss = LOSS_AGGREGATIONS.get(name)(out.per_token, inputs.mask, LossNormalizer(1.0, 1.0, 4))
        assert loss.item() == 0.0 and torch.isfinite(loss)


def test_kl_k3_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.2)])
    # ratio ref/pi = 0.5 -> 0.5 - log(0.5) - 1
    expected = torch.tensor([0.5 - math.log(0.5) - 1.0, 0.0])
    assert torch.allclose(kl_k3(logp, ref), expected, atol=1e-6)


PER_TOKEN = [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
# sequences: sums 6, 4, 11 over 3, 1, 2 tokens; 6 tokens, 3 sequences, a budget of 4 tokens
BY_HAND = {
    "token_mean": 21 / 6,
    "seq_mean_token_mean": (2 + 4 + 5.5) / 3,
    "seq_mean_token_sum": 21 / 3,
    "seq_mean_token_sum_norm": 21 / (3 * 4),
}


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_aggregations_by_hand_and_exact_under_any_split(name):
    per_token = torch.tensor(PER_TOKEN, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    agg = LOSS_AGGREGATIONS.get(name)
    norm = LossNormalizer(tokens=mask.sum(), sequences=torch.tensor(3.0, dtype=torch.float64), max_tokens=4)
    whole = agg(per_token, mask, norm)
    assert whole.item() == pytest.approx(BY_HAND[name])
    (grad_whole,) = torch.autograd.grad(whole, per_token)
    for cut in (1, 2):
        split = agg(per_token[:cut], mask[:cut], norm) + agg(per_token[cut:], mask[cut:], norm)
        assert split.item() == pytest.approx(whole.item())
        (grad_split,) = torch.autograd.grad(split, per_token)
        assert torch.allclose(grad_split, grad_whole)


def test_naive_per_micro_batch_mean_is_not_the_whole_batch_mean():
    per_token, mask = torch.tensor(PER_TOKEN), torch.tensor(MASK)
    agg = LOSS_AGGREGATIONS.get("token_mean")
    local = lambda m: LossNormalizer(m.sum(), 1.0, 4)  # noqa: E731 - each micro-batch's own count
    naive = (agg(per_token[:2], mask[:2], local(mask[:2])) + agg(per_token[2:], mask[2:], local(mask[2:]))) / 2
    assert naive.item() == pytest.approx(4.0)  # (10/4 + 11/2) / 2, not 3.5


def test_registry_rejects_duplicates_and_names_known_entries():
    reg = Registry("thing")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(ValueError, match="unknown thing 'b'; registered: a"):
        reg.get("b")
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGES.register("grpo")(lambda inputs: inputs)
