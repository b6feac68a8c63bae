"""Advantage estimators against values computed by hand (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.algorithms import ADVANTAGES, AdvantageInputs

NAN = float("nan")


def adv(name, rewards, groups, **kw):
    fields = {k: kw.pop(k) for k in ("response_mask", "token_rewards", "values", "baseline_rewards") if k in kw}
    fields = {k: torch.tensor(v, dtype=torch.float64) for k, v in fields.items()}
    inputs = AdvantageInputs(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), **fields)
    return ADVANTAGES.get(name)(inputs, **kw)


def test_grpo_std_conventions_and_dr_grpo():
    # group [1, 0, 0, 1]: mean 0.5; unbiased std sqrt(1/3) = 0.57735, population std 0.5
    r, g = [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0]
    assert adv("grpo", r, g, eps=0.0).tolist() == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254])
    assert adv("grpo", r, g, eps=0.0, std="biased").tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert adv("dr_grpo", r, g).tolist() == [0.5, -0.5, -0.5, 0.5]


def test_rloo_leave_one_out_baseline_skips_unscorable_and_lone_samples():
    # group 0: [1, 0, 2]: baselines (0+2)/2 = 1, (1+2)/2 = 1.5, (1+0)/2 = 0.5 -> 0, -1.5, 1.5
    # group 1: [3, NaN]: one scorable sample, no baseline -> 0; the NaN -> 0
    out = adv("rloo", [1.0, 0.0, 2.0, 3.0, NAN], [0, 0, 0, 1, 1])
    assert out.tolist() == [0.0, -1.5, 1.5, 0.0, 0.0]
    # = k/(k-1) * (r - mean): mean 1, k 3 -> 1.5 * (r - 1)
    assert out[:3].tolist() == [1.5 * (x - 1.0) for x in (1.0, 0.0, 2.0)]


def test_remax_subtracts_the_greedy_reward():
    out = adv("remax", [1.0, 0.0, NAN], [0, 0, 1], baseline_rewards=[0.5, 0.5, 1.0])
    assert out.tolist() == [0.5, -0.5, 0.0]
    with pytest.raises(ValueError, match="baseline_rewards"):
        adv("remax", [1.0], [0])


def test_reinforce_pp_returns_with_kl_penalty_normalised_over_the_batch():
    # two samples of 2 and 1 response tokens, gamma 1, per-token rewards -0.1 (a KL penalty)
    mask = [[1, 1, 0], [0, 1, 0]]
    token = [[-0.1, -0.1, 5.0], [7.0, -0.1, 0.0]]  # masked entries must not count
    out = adv("reinforce_pp", [1.0, 0.0], [0, 1], response_mask=mask, token_rewards=token, eps=0.0)
    # returns: row 0: t1 = -0.1 + 1 = 0.9, t0 = -0.1 + 0.9 = 0.8; row 1: t1 = -0.1 + 0 = -0.1
    g = [0.8, 0.9, -0.1]
    mean = sum(g) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 2)
    want = [[(0.8 - mean) / std, (0.9 - mean) / std, 0.0], [0.0, (-0.1 - mean) / std, 0.0]]
    assert out.tolist() == [pytest.approx(row) for row in want]


def test_reinforce_pp_baseline_centres_each_group_first():
    mask = [[1, 0], [1, 0], [1, 1]]
    out = adv("reinforce_pp_baseline", [1.0, 0.0, NAN], [0, 0, 0], response_mask=mask, eps=0.0)
    # group mean of scorable (1, 0) = 0.5 -> outcomes 0.5, -0.5; the NaN sample is masked out
    # returns: 0.5, -0.5 (one token each) -> mean 0, unbiased std sqrt(0.5) -> +-0.7071
    assert out.tolist() == [pytest.approx([0.70710678, 0.0]), pytest.approx([-0.70710678, 0.0]), [0.0, 0.0]]


def test_gae_by_hand_and_masked_values_do_not_matter():
    # one sample, response at positions 1..3, gamma 0.9, lambda 0.8, outcome 1 on the last token
    mask = [[0, 1, 1, 1, 0]]
    values = [[99.0, 0.5, 0.4, 0.2, -99.0]]
    out = adv("gae", [1.0], [0], response_mask=mask, values=values, gamma=0.9, lam=0.8, whiten=False)
    d3 = 1.0 + 0.9 * 0.0 - 0.2  # 0.8
    d2 = 0.0 + 0.9 * 0.2 - 0.4  # -0.22
    d1 = 0.0 + 0.9 * 0.4 - 0.5  # -0.14
    a3 = d3
    a2 = d2 + 0.72 * a3
    a1 = d1 + 0.72 * a2
    assert out.tolist() == [pytest.approx([0.0, a1, a2, a3, 0.0])]
    other = adv(
        "gae", [1.0], [0], response_mask=mask, values=[[-5.0, 0.5, 0.4, 0.2, 1e6]], gamma=0.9, lam=0.8, whiten=False
    )
    assert torch.equal(out, other)
    # a hole in the mask (a tool's output, say) is skipped: its value never enters the result
    holed = adv(
        "gae", [1.0], [0], response_mask=[[1, 0, 1]], values=[[0.5, 123.0, 0.2]], gamma=1.0, lam=1.0, whiten=False
    )
    assert holed.tolist() == [pytest.approx([1.0 - 0.5, 0.0, 1.0 - 0.2])]


def test_gae_whitens_over_the_batch_by_default_and_its_returns_stay_raw():
    # two samples: raw GAE (gamma = lambda = 1, values 0) gives each token the outcome: [2, 2] and [0, -]
    mask = [[1, 1], [1, 0]]
    values = [[0.0, 0.0], [0.0, 0.0]]
    out = adv("gae", [2.0, 0.0], [0, 1], response_mask=mask, values=values, gamma=1.0, lam=1.0)
    # masked tokens 2, 2, 0: mean 4/3, unbiased var ((2/3)^2 * 2 + (4/3)^2) / 2 = 4/3
    scale = (4 / 3 + 1e-8) ** -0.5
    assert out.tolist() == [pytest.approx([2 / 3 * scale] * 2), pytest.approx([-4 / 3 * scale, 0.0])]
    from postrl.algorithms import VALUE_TARGETS, AdvantageInputs

    inputs = AdvantageInputs(
        torch.tensor([2.0, 0.0]),
        torch.tensor([0, 1]),
        response_mask=torch.tensor(mask, dtype=torch.float32),
        values=torch.tensor([[0.5, 0.25], [0.1, 9.0]]),
    )
    # returns = raw advantage + value = the outcome on every token (gamma = lambda = 1), whitened or not
    returns = VALUE_TARGETS.get("gae")(inputs, gamma=1.0, lam=1.0, whiten=True)
    assert returns.tolist() == [pytest.approx([2.0, 2.0]), pytest.approx([0.0, 0.0])]


def test_estimators_are_finite_on_equal_rewards_single_samples_and_all_unscorable():
    mask = [[1, 1], [1, 0], [1, 1]]
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        for rewards, groups in (([1.0, 1.0, 1.0], [0, 0, 0]), ([1.0, 0.0, 2.0], [0, 1, 2]), ([NAN] * 3, [0, 0, 0])):
            out = adv(name, rewards, groups, response_mask=mask)
            assert torch.isfinite(out).all(), (name, rewards)
            if rewards == [NAN] * 3 or len(set(groups)) == 3 and name in ("grpo", "dr_grpo", "rloo"):
                assert (out == 0).all(), (name, rewards)
