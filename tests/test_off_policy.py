"""Decoupled PPO: the proximal policy recomputed by the trainer, TIS/MIS weights for the gap to the
behaviour policy, and how ``algorithm.old_logprobs`` resolves."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from postrl.algorithms import IMPORTANCE_CORRECTIONS
from postrl.config.run import AlgorithmConfig, RunConfig, TrainConfig
from postrl.controller.overlap import resolve_overlap
from postrl.models.numerics import Machine, resolve_numerics
from postrl.rollout.native import NativeRolloutWorker
from postrl.train.worker import PolicyTrainer
from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams
from tests.conftest import make_tiny_model

LN = math.log


def _weights(name, proximal, behaviour, mask, **options):
    return IMPORTANCE_CORRECTIONS.get(name)(
        torch.tensor(proximal), torch.tensor(behaviour), torch.tensor(mask), **options
    )


def test_tis_token_level_against_hand_values():
    # ratios pi_prox / pi_behav: 4, 1/4, 1.5 ; the last token is padding
    proximal = [[LN(0.8), LN(0.1), LN(0.6), 0.0]]
    behaviour = [[LN(0.2), LN(0.4), LN(0.4), 5.0]]
    out = _weights("tis", proximal, behaviour, [[1.0, 1.0, 1.0, 0.0]], low=0.5, high=2.0)
    assert out.weights.tolist()[0] == pytest.approx([2.0, 0.5, 1.5, 0.0])
    assert out.rejected.tolist() == [[True, True, False, False]]
    # the default is Yao et al.'s min(ratio, 2): no lower bound
    out = _weights("tis", proximal, behaviour, [[1.0, 1.0, 1.0, 0.0]])
    assert out.weights.tolist()[0] == pytest.approx([2.0, 0.25, 1.5, 0.0])


def test_mis_masks_tokens_and_whole_sequences_outside_the_bounds():
    proximal = [[LN(0.8), LN(0.1), LN(0.6)], [LN(0.5), LN(0.5), 0.0]]
    behaviour = [[LN(0.2), LN(0.4), LN(0.4)], [LN(0.4), LN(0.5), 0.0]]
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    token = _weights("mis", proximal, behaviour, mask, low=0.5, high=2.0)
    assert token.weights.tolist()[0] == pytest.approx([0.0, 0.0, 1.5])
    assert token.weights.tolist()[1] == pytest.approx([1.25, 1.0, 0.0])
    # sequence level: row 0's product 4 * 1/4 * 1.5 = 1.5 is inside, row 1's 1.25 too
    seq = _weights("mis", proximal, behaviour, mask, level="sequence", low=0.5, high=1.4)
    assert seq.weights.tolist()[0] == pytest.approx([0.0, 0.0, 0.0])  # 1.5 > 1.4: the whole sequence
    assert seq.weights.tolist()[1] == pytest.approx([1.25, 1.25, 0.0])
    assert seq.rejected.tolist() == [[True, True, True], [False, False, False]]
    tis = _weights("tis", proximal, behaviour, mask, level="sequence", low=0.5, high=1.4)
    assert tis.weights.tolist()[0] == pytest.approx([1.4, 1.4, 1.4])


def test_importance_bounds_are_checked():
    with pytest.raises(ValueError, match="0 <= low <= 1 <= high"):
        _weights("tis", [[0.0]], [[0.0]], [[1.0]], low=0.5, high=0.9)
    with pytest.raises(ValueError, match="unknown importance correction 'icepop'"):
        AlgorithmConfig(importance={"type": "icepop"})
    with pytest.raises(ValueError, match="old_logprobs=rollout uses the engine's directly"):
        AlgorithmConfig(old_logprobs="rollout", importance={"type": "mis"})


def test_importance_is_a_tagged_union_with_each_kinds_own_defaults(monkeypatch):
    """Each correction's fields and defaults are its own: a bound of MIS is not TIS's, a field of one
    kind is refused in another, a plugin's name takes its own params."""
    assert AlgorithmConfig().importance.options() == {"level": "token", "low": 0.0, "high": 2.0}
    assert AlgorithmConfig(importance="mis").importance.options() == {"level": "token", "low": 0.5, "high": 2.0}
    assert AlgorithmConfig(importance="none").importance.options() == {}
    with pytest.raises(ValueError, match="importance.none.low"):
        AlgorithmConfig(importance={"type": "none", "low": 0.5})
    with pytest.raises(ValueError, match="importance.tis.params"):
        AlgorithmConfig(importance={"type": "tis", "params": {"c": 2}})

    monkeypatch.setitem(IMPORTANCE_CORRECTIONS._entries, "clip_at", lambda proximal, behaviour, mask, c=1.0: None)
    plugin = AlgorithmConfig(importance={"type": "clip_at", "params": {"c": 3.0}}).importance
    assert plugin.type == "clip_at" and plugin.options() == {"c": 3.0}


def test_the_built_in_loss_aggregations_are_the_config_literal():
    from typing import get_args

    from postrl.algorithms import LOSS_AGGREGATIONS
    from postrl.config.algorithm import LossAggregation

    built_in = {n for n in LOSS_AGGREGATIONS.names() if LOSS_AGGREGATIONS.get(n).__module__.startswith("postrl.")}
    assert set(get_args(LossAggregation)) == built_in  # (other tests register their own)
    with pytest.raises(ValueError, match="unknown loss aggregation 'token_sum'"):
        AlgorithmConfig(loss_agg="token_sum")


def old_logprobs_source(config: RunConfig) -> str:
    return resolve_numerics(config, Machine(engine_bf16_fast=False, trainer_bf16=False, gpu=False)).proximal


def test_old_logprobs_auto_recomputes_whenever_engine_and_trainer_may_differ():
    """Alike numerics off-policy (async, staleness, replay) leave only the version gap: approximate."""
    assert old_logprobs_source(RunConfig()) == "rollout"  # fp32 native engine, fp32 trainer, sync
    assert old_logprobs_source(RunConfig(rollout={"dtype": "bfloat16"})) == "recompute"
    assert old_logprobs_source(RunConfig(rollout={"dtype": "auto"})) == "recompute"
    assert old_logprobs_source(RunConfig(train={"precision": "bf16_autocast"})) == "recompute"
    async_fp32 = RunConfig(buffer={"max_staleness": 1}, controller={"mode": "async"})
    assert old_logprobs_source(async_fp32) == "approximate"  # fp32 alike: only the version gap
    async_bf16 = RunConfig(rollout={"dtype": "bfloat16"}, buffer={"max_staleness": 1}, controller={"mode": "async"})
    assert old_logprobs_source(async_bf16) == "recompute"  # a precision gap too
    assert old_logprobs_source(RunConfig(rollout={"dtype": "bfloat16"}, algorithm={"old_logprobs": "rollout"})) == (
        "rollout"
    )
    exact_bf16 = {"rollout": {"exact": True, "dtype": "bfloat16"}, "train": {"precision": "bf16_autocast"}}
    assert old_logprobs_source(RunConfig(**exact_bf16)) == "rollout"  # the engine's logprobs are the trainer's
    async_exact = RunConfig(**exact_bf16, buffer={"max_staleness": 1}, controller={"mode": "async"})
    assert old_logprobs_source(async_exact) == "approximate"


def _engine_batch(tokenizer, model, dtype=torch.float32, n=4, advantage=lambda i: float(i % 3) - 1.0):
    engine = NativeRolloutWorker.from_hf(model, tokenizer, dtype=dtype, seed=3)
    prompts = [Prompt(text=t, prompt_ids=tokenizer(t)["input_ids"]) for t in ("12+34=", "7+5=", "99+1=")]
    rollouts = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=8), 0)
    exps = [
        Experience(r.prompt_ids, r.response_ids, r.logprobs, 1.0, advantage(i), 0, group_id=r.prompt_index)
        for i, r in enumerate(rollouts)
    ]
    return ExperienceBatch.from_experiences(exps, tokenizer.pad_token_id)


def test_recomputed_proximal_logprobs_equal_the_fp32_engines(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    batch = _engine_batch(char_tokenizer, model)
    worker = PolicyTrainer(model, TrainConfig(mini_batch_size=4, micro_batch_size=2), AlgorithmConfig())
    proximal = worker.proximal_logprobs(batch, worker._group_shuffled_order(batch))
    diff = ((proximal - batch.old_logprobs) * batch.response_mask).abs().max().item()
    assert diff < 1e-4
    assert (proximal * (1 - batch.response_mask)).abs().max().item() == 0.0
    # a bf16 engine's logprobs are another policy: the gap is what the correction is for
    bf16 = _engine_batch(char_tokenizer, make_tiny_model("llama", char_tokenizer), dtype=torch.bfloat16)
    prox16 = worker.proximal_logprobs(bf16, worker._group_shuffled_order(bf16))
    assert ((prox16 - bf16.old_logprobs) * bf16.response_mask).abs().max().item() > 1e-3


def _recording(worker):
    seen = []
    loss = worker.policy_loss

    def record(inputs):
        seen.append(inputs)
        return loss(inputs)

    worker.policy_loss = record
    return seen


def test_with_recompute_the_first_micro_batchs_ratio_is_exactly_one(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    batch = _engine_batch(char_tokenizer, model)
    batch.old_logprobs = batch.old_logprobs - 0.3 * batch.response_mask  # a behaviour policy that differs
    worker = PolicyTrainer(
        model, TrainConfig(mini_batch_size=6, micro_batch_size=3, lr=1e-2), AlgorithmConfig(), proximal="recompute"
    )
    seen = _recording(worker)
    drawn_from = worker.generator.get_state()
    order = worker._group_shuffled_order(batch)  # the order update() will draw
    worker.generator.set_state(drawn_from)
    metrics = worker.update(batch)
    first = seen[0]
    assert torch.equal(first.logprobs.detach() * first.mask, first.old_logprobs * first.mask)
    # the first mini-batch's proximal is its own forward; a separate no-grad pass gives the same numbers
    worker.model.load_state_dict(make_tiny_model("llama", char_tokenizer).state_dict())
    prepass = worker.proximal_logprobs(batch, order)[order[:3]]
    assert torch.equal(prepass * first.mask, first.old_logprobs * first.mask)
    ratio = torch.exp(first.logprobs.detach() - first.old_logprobs)[first.mask.bool()]
    assert torch.all(ratio == 1.0)
    # after the first optimizer step the policy moved: the second mini-batch's ratio is not 1
    later = seen[-1]
    assert not torch.equal(later.logprobs.detach() * later.mask, later.old_logprobs * later.mask)
    # pi_prox / pi_behav = e^0.3 = 1.35 on every token, inside TIS's [0, 2]: weight 1.35, nothing truncated
    assert metrics.get("rollout/is_weight_mean") == pytest.approx(math.exp(0.3), rel=1e-4)
    assert metrics.get("rollout/is_rejected_fraction") == 0.0
    assert metrics.get("rollout/mismatch_kl") == pytest.approx(
        math.exp(0.3) - 0.3 - 1, rel=1e-3
    )  # k3 of KL(behaviour || proximal)
    # the engine's logprobs used directly: the ratio is e^0.3 from the start
    direct = PolicyTrainer(
        make_tiny_model("llama", char_tokenizer), TrainConfig(mini_batch_size=6, micro_batch_size=3), AlgorithmConfig()
    )
    seen = _recording(direct)
    direct.update(batch)
    ratio = torch.exp(seen[0].logprobs.detach() - seen[0].old_logprobs)[seen[0].mask.bool()]
    assert ratio.min().item() == pytest.approx(math.exp(0.3), rel=1e-4)


@pytest.mark.slow
def test_decoupled_loss_is_the_clipped_surrogate_times_the_weight(char_tokenizer):
    """MIS drops the tokens whose behaviour ratio leaves the bounds: their gradient is zero, the
    others' is the plain PPO gradient times the weight."""
    grads = {}
    for name, shift in (("plain", 0.0), ("mis", 0.3), ("mis_out", 1.0)):
        model = make_tiny_model("llama", char_tokenizer).double()
        # advantages of one sign: the gradient is no difference of near-equal terms (float32 rotary noise)
        batch = _engine_batch(char_tokenizer, make_tiny_model("llama", char_tokenizer), advantage=lambda i: 1.0 + i % 3)
        batch = batch._map(lambda t: t.double() if t.is_floating_point() else t)
        algo = AlgorithmConfig(importance={"type": "mis", "low": 0.5, "high": 2.0})
        train = TrainConfig(mini_batch_size=12, micro_batch_size=12, grad_clip=1e9)
        worker = PolicyTrainer(model, train, algo, proximal="recompute")
        proximal = worker.proximal_logprobs(batch, torch.arange(batch.size))
        batch.old_logprobs = (proximal - shift) * batch.response_mask
        worker.optimization.step = lambda norm: False  # keep the gradient, take no step
        metrics = worker.update(batch)
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        grads[name + "_metrics"] = metrics
    assert grads["plain"].abs().max().item() > 0
    scaled = grads["plain"] * math.exp(0.3)
    assert ((grads["mis"] - scaled).norm() / scaled.norm()).item() < 1e-6
    assert grads["mis_out"].abs().max().item() == 0.0  # e^1 = 2.72 > 2: every token masked
    assert grads["mis_out_metrics"].get("rollout/is_rejected_fraction") == 1.0
    assert grads["plain_metrics"].get("rollout/is_weight_mean") == pytest.approx(1.0)


def test_async_settings_that_cannot_work_are_refused_naming_the_fields():
    with pytest.raises(ValueError, match="set buffer.max_staleness >= 1"):
        RunConfig(controller={"mode": "async"})
    with pytest.raises(ValueError, match="scheduler.rollout_schedule resizes the rollout pool"):
        RunConfig(controller={"mode": "async"}, buffer={"max_staleness": 1}, scheduler={"rollout_schedule": {3: 2}})
    ok = RunConfig(controller={"mode": "async"}, buffer={"max_staleness": 1})
    assert (
        resolve_overlap(ok).runs == "scoring"
        and resolve_overlap(RunConfig(controller={"mode": "async"}, buffer={"max_staleness": 1}, scheduler="ray")).runs
        == "generation"
    )


def test_interpolated_proximal_against_hand_values():
    from postrl.algorithms.importance import interpolated_proximal

    behaviour = torch.tensor([[LN(0.2), LN(0.4), LN(0.5), 0.0]])
    current = torch.tensor([[LN(0.8), LN(0.1), LN(0.9), 0.0]])
    lags = torch.tensor([[1, 0, 2, -1]])
    half = interpolated_proximal(behaviour, current, lags, progress=0.5)
    # alpha = lag / (lag + 0.5): 2/3, 0 (the proximal version's own token keeps its behaviour logprob), 4/5
    expected = [LN(0.2) + 2 / 3 * LN(4.0), LN(0.4), LN(0.5) + 0.8 * LN(1.8), 0.0]
    assert half.tolist()[0] == pytest.approx(expected, abs=1e-6)
    # before the update's first step the current policy is the proximal one: exactly, not approximately
    assert torch.equal(interpolated_proximal(behaviour, current, lags, progress=0.0), current)
    with pytest.raises(ValueError, match=r"progress must be in \[0, 1\)"):
        interpolated_proximal(behaviour, current, lags, progress=1.0)


def test_approximate_needs_no_extra_forward_and_interpolates_after_the_first_step(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    batch = _engine_batch(char_tokenizer, model).with_lags(1)  # generated one version behind
    batch.old_logprobs = batch.old_logprobs - 0.3 * batch.response_mask
    train = TrainConfig(mini_batch_size=6, micro_batch_size=3, lr=1e-2)
    forwards = {}
    for source in ("recompute", "approximate"):
        worker = PolicyTrainer(make_tiny_model("llama", char_tokenizer), train, AlgorithmConfig(), proximal=source)
        calls: list[int] = []
        worker.model.get_input_embeddings().register_forward_hook(lambda *_, calls=calls: calls.append(1))
        seen = _recording(worker)
        drawn_from = worker.generator.get_state()
        order = worker._group_shuffled_order(batch)  # the order update() will draw
        worker.generator.set_state(drawn_from)
        worker.update(batch)
        forwards[source] = len(calls)
    assert forwards == {"recompute": 6, "approximate": 4}  # 2 minis x 2 micros; recompute's pre-pass of the second
    first, last = seen[0], seen[-1]
    assert torch.equal(first.logprobs.detach() * first.mask, first.old_logprobs * first.mask)  # exact: ratio 1
    # the last micro-batch trains halfway through the update (1 of 2 steps taken): alpha = 1 / (1 + 1/2)
    rows = batch.select(order[9:12])
    width = last.mask.shape[1]
    behaviour, response = rows.old_logprobs[:, :width], rows.response_mask[:, :width]
    expected = torch.lerp(behaviour, last.logprobs.detach(), 2 / 3) * response
    assert torch.allclose(last.old_logprobs, expected, atol=1e-6)
    assert not torch.allclose(last.old_logprobs, last.logprobs.detach() * response, atol=1e-3)
    with pytest.raises(ValueError, match="needs the batch's token_lags"):
        PolicyTrainer(model, train, AlgorithmConfig(), proximal="approximate").update(
            _engine_batch(char_tokenizer, model)
        )


def test_token_lags_count_from_the_trainers_version():
    batch = ExperienceBatch.from_experiences([Experience([1, 2], [3, 4], [-0.5, -0.5], 1.0, 1.0, 3)], 0)
    batch.logprob_versions = torch.tensor([[-1, 3, 4]])  # the second token came after an in-flight update
    assert batch.with_lags(5).token_lags.tolist() == [[-1, 2, 1]]


def test_each_old_logprobs_value_is_one_proximal_object():
    """rollout: no correction; recompute: the batch's prepass, or in a one-epoch update the first
    mini-batch's own forward; approximate: its own forward before any step, interpolated after."""
    from postrl.train.proximal import Approximate, BehaviourIsOld, Recompute, proximal_policy

    behaviour, own = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -0.5, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    prepass = torch.tensor([[0.0, -0.7, -1.4]])
    micro = SimpleNamespace(old_logprobs=behaviour, response_mask=mask, proximal_logprobs=prepass,
                            token_lags=torch.tensor([[0, 2, 2]]))  # fmt: skip
    assert proximal_policy("rollout", None, 1).for_micro(micro, own, 0.5) is None
    assert isinstance(proximal_policy("rollout", None, 1), BehaviourIsOld)
    one_epoch, two = Recompute(None, epochs=1), Recompute(None, epochs=2)
    assert torch.equal(one_epoch.for_micro(micro, own, 0.0), own * mask)
    assert one_epoch.for_micro(micro, own, 0.25) is prepass and two.for_micro(micro, own, 0.0) is prepass
    approx = Approximate()
    assert torch.equal(approx.for_micro(micro, own, 0.0), own * mask)
    after = approx.for_micro(micro, own, 0.5)
    assert not torch.equal(after, own * mask) and float(after[0, 0]) == 0.0  # interpolated, still masked
    with pytest.raises(ValueError, match="token_lags"):
        approx.prepare(SimpleNamespace(token_lags=None), torch.arange(1))


def test_tokens_lagging_past_max_token_lag_leave_the_loss_and_are_counted():
    """lags [-1, 2, 1] from version 5: with max_token_lag=1 the lag-2 token leaves the loss (one token
    masked), the lag-1 token and the prompt position stay as they were."""
    batch = ExperienceBatch.from_experiences([Experience([1, 2], [3, 4], [-0.5, -0.5], 1.0, 1.0, 3)], 0)
    batch.logprob_versions = torch.tensor([[-1, 3, 4]])
    kept, masked = batch.with_lags(5).without_lagging_tokens(1)
    assert kept.loss_mask.tolist() == [[0.0, 0.0, 1.0]] and masked == 1.0
    assert batch.with_lags(5).without_lagging_tokens(2)[1] == 0.0
    with pytest.raises(ValueError, match="token_lags"):
        batch.without_lagging_tokens(1)
