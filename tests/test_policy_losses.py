"""Policy losses and KL estimators against values computed by hand (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.algorithms import KL_ESTIMATORS, POLICY_LOSSES, LossInputs, kl_penalty


def inputs(logp, old, adv, mask=None):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float64)
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float64)
    return logp, LossInputs(logp, old, torch.tensor(adv, dtype=torch.float64), mask)


L = math.log


def test_ppo_asymmetric_clip_and_dual_clip_by_hand():
    # ratios 1.5, 0.5, 1.25, 4.0 (log-ratios); clip bounds [0.8, 1.28]
    ratios = [1.5, 0.5, 1.25, 4.0]
    logp, x = inputs([[L(r) for r in ratios]] * 2, [[0.0] * 4] * 2, [1.0, -1.0])
    out = POLICY_LOSSES.get("ppo_clip")(x, clip_eps_low=0.2, clip_eps_high=0.28)
    # A = +1: -min(r, clip(r)) = -1.28, -0.5, -1.25, -1.28 ; A = -1: max(r, clip(r)) = 1.5, 0.8, 1.25, 4.0
    assert out.per_token.tolist() == [pytest.approx([-1.28, -0.5, -1.25, -1.28]), pytest.approx([1.5, 0.8, 1.25, 4.0])]
    assert out.metrics["actor/clip_high"].per_token.tolist() == [[1, 0, 0, 1], [0, 0, 0, 0]]
    assert out.metrics["actor/clip_low"].per_token.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0]]
    assert out.metrics["actor/clip_fraction"].per_token.tolist() == [[1, 0, 0, 1], [0, 1, 0, 0]]
    dual = POLICY_LOSSES.get("ppo_clip")(x, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0)
    # the negative-advantage token with ratio 4 has loss 4 > c |A| = 3: bounded to 3
    assert dual.per_token[1].tolist() == pytest.approx([1.5, 0.8, 1.25, 3.0])
    assert dual.metrics["actor/dual_clip"].per_token.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    dual.per_token.sum().backward()
    assert logp.grad[1, 3] == 0 and logp.grad[0, 0] == 0  # no gradient through either bound
    assert logp.grad[1, 2].item() == pytest.approx(1.25)  # d(-A r)/dlogp = -A r
    # approx KL(pi_old || pi) from samples of pi_old, k3 with x = pi/pi_old = r: (r - 1) - log r
    assert out.metrics["actor/approx_kl"].per_token[0].tolist() == pytest.approx([r - 1 - L(r) for r in ratios])


def test_log_ratio_is_clamped_before_exp():
    _, x = inputs([[500.0]], [[0.0]], [-1.0])
    out = POLICY_LOSSES.get("ppo_clip")(x)
    assert torch.isfinite(out.per_token).all() and out.per_token.item() == pytest.approx(math.exp(20.0))


def test_gspo_sequence_ratio_on_responses_of_different_lengths():
    # seq 0: 3 tokens, log-ratios 0.3, -0.1, 0.1 -> mean 0.1; seq 1: 1 token (+2 masked) log-ratio 0.2
    logp, x = inputs([[0.3, -0.1, 0.1], [0.2, 9.0, 9.0]], [[0.0] * 3] * 2, [1.0, -1.0], mask=[[1, 1, 1], [1, 0, 0]])
    out = POLICY_LOSSES.get("gspo")(x, clip_eps_low=0.5, clip_eps_high=0.5)
    s0, s1 = math.exp(0.1), math.exp(0.2)
    assert out.per_token.tolist() == [pytest.approx([-s0] * 3), pytest.approx([s1, 0.0, 0.0])]
    out.per_token.sum().backward()
    # every token of seq 0 gets -A * s0 (its loss is -A * s_i,t, s_i,t = sg(s_i) * pi/sg(pi))
    assert logp.grad[0].tolist() == pytest.approx([-s0] * 3)
    assert logp.grad[1].tolist() == pytest.approx([s1, 0.0, 0.0])
    tight = POLICY_LOSSES.get("gspo")(x)  # 3e-4 / 4e-4: both sequences are clipped
    assert tight.metrics["actor/clip_high"].per_token[0].tolist() == [1, 1, 1] and tight.metrics[
        "actor/clip_low"
    ].per_token[1].tolist() == [0, 0, 0]
    # A < 0 with the ratio above the bound: the unclipped loss is the larger, so it stays (pessimistic bound)
    assert tight.metrics["actor/clip_fraction"].per_token[1].tolist() == [0, 0, 0]


def test_cispo_clipped_stop_gradient_weight_on_reinforce():
    ratios = [0.5, 1.0, 2.0]
    logp, x = inputs([[L(r) for r in ratios]], [[0.0] * 3], [2.0])
    out = POLICY_LOSSES.get("cispo")(x, clip_eps_low=0.2, clip_eps_high=0.28)
    weights = [0.8, 1.0, 1.28]
    assert out.per_token[0].tolist() == pytest.approx([-w * 2.0 * L(r) for w, r in zip(weights, ratios)])
    out.per_token.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-w * 2.0 for w in weights])  # every token keeps a gradient
    assert out.metrics["actor/clip_low"].per_token.tolist() == [[1, 0, 0]] and out.metrics[
        "actor/clip_high"
    ].per_token.tolist() == [[0, 0, 1]]


def test_reinforce_by_hand():
    logp, x = inputs([[-1.0, -2.0]], [[-1.5, -1.5]], [0.5], mask=[[1, 0]])
    out = POLICY_LOSSES.get("reinforce")(x)
    assert out.per_token.tolist() == [[0.5, 0.0]]
    out.per_token.sum().backward()
    assert logp.grad.tolist() == [[-0.5, 0.0]]


def test_all_masked_batch_gives_a_finite_zero_loss_for_every_loss():
    for name in ("ppo_clip", "gspo", "cispo", "reinforce"):
        _, x = inputs([[0.3, 0.1]], [[0.0, 0.0]], [1.0], mask=[[0, 0]])
        out = POLICY_LOSSES.get(name)(x)
        assert torch.isfinite(out.per_token).all() and out.per_token.abs().sum() == 0, name


def test_kl_estimators_by_hand_and_clamp():
    logp = torch.tensor([L(0.5), L(0.2)], dtype=torch.float64)
    ref = torch.tensor([L(0.25), L(0.4)], dtype=torch.float64)
    x = [L(2.0), L(0.5)]  # log pi - log ref
    assert KL_ESTIMATORS.get("k1")(logp, ref).tolist() == pytest.approx(x)
    assert KL_ESTIMATORS.get("k2")(logp, ref).tolist() == pytest.approx([v * v / 2 for v in x])
    assert KL_ESTIMATORS.get("k3")(logp, ref).tolist() == pytest.approx([math.exp(-v) + v - 1 for v in x])
    assert KL_ESTIMATORS.get("abs")(logp, ref).tolist() == pytest.approx([math.log(2.0), math.log(2.0)])  # |x|
    assert kl_penalty(logp, ref, "k1", clamp=0.5).tolist() == pytest.approx([0.5, -0.5])
