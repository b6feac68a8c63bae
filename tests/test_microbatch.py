"""The loss and its gradient do not change with the micro-batch split (uneven token counts)."""

from __future__ import annotations

import copy

import pytest
import torch

from postrl.algorithms import register_loss_aggregation
from postrl.config.run import AlgorithmConfig, TrainConfig
from postrl.train.worker import PolicyTrainer
from postrl.types import Experience, ExperienceBatch
from tests.conftest import make_tiny_model


def uneven_batch(tokenizer) -> ExperienceBatch:
    gen = torch.Generator().manual_seed(3)
    exps = []
    for i, length in enumerate([1, 7, 3, 12, 2, 5]):
        prompt = torch.randint(10, 60, (4 + i % 3,), generator=gen).tolist()
        response = torch.randint(10, 60, (length,), generator=gen).tolist()
        logprobs = (-torch.rand(length, generator=gen) * 3).tolist()
        exps.append(Experience(prompt, response, logprobs, 1.0, (-1.0) ** i * (0.5 + i / 10), 0))
    return ExperienceBatch.from_experiences(exps, tokenizer.pad_token_id)


@register_loss_aggregation("test_naive_micro_mean")
def naive_micro_mean(per_token: torch.Tensor, mask: torch.Tensor, norm) -> torch.Tensor:
    """Wrong on purpose: each micro-batch's own token mean, ignoring the mini-batch's token count."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def grads_with_micro(
    model, batch, micro: int, kl_beta: float = 0.0, ref=None, loss_agg: str = "token_mean"
) -> tuple[list[torch.Tensor], float]:
    worker = PolicyTrainer(
        model,
        TrainConfig(lr=1e-3, mini_batch_size=6, micro_batch_size=micro),
        AlgorithmConfig(kl_beta=kl_beta, loss_agg=loss_agg),
        ref_model=ref,
    )
    model.zero_grad(set_to_none=True)
    sums = worker.accumulate_gradients(batch)
    return [p.grad.detach().clone() for p in model.parameters()], float(sums.value("actor/loss") / sums.value("tokens"))


@pytest.mark.parametrize(
    "loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_gradient_unchanged_by_micro_batch_split(char_tokenizer, loss_agg):
    batch = uneven_batch(char_tokenizer)
    base = make_tiny_model("llama", char_tokenizer).double()
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01)
    results = [
        grads_with_micro(copy.deepcopy(base), batch, m, kl_beta=0.1, ref=ref, loss_agg=loss_agg) for m in (6, 1, 4)
    ]
    (g_full, loss_full), *others = results
    for grads, loss in others:
        assert abs(loss - loss_full) < 1e-10
        for a, b in zip(g_full, grads):
            assert torch.allclose(a, b, atol=1e-10, rtol=1e-8)


def test_naive_per_micro_batch_mean_changes_the_gradient(char_tokenizer):
    """The test above can fail: through the same trainer code path, an aggregation that averages each
    micro-batch on its own gives a gradient that depends on the split."""
    batch = uneven_batch(char_tokenizer)
    base = make_tiny_model("llama", char_tokenizer).double()
    whole, _ = grads_with_micro(copy.deepcopy(base), batch, 6, loss_agg="test_naive_micro_mean")
    split, _ = grads_with_micro(copy.deepcopy(base), batch, 2, loss_agg="test_naive_micro_mean")
    assert max(float((a - b).abs().max()) for a, b in zip(whole, split)) > 1e-4


def test_entropy_bonus_subtracts_coef_times_the_token_mean_entropy_gradient(char_tokenizer):
    from postrl.train.logprobs import token_logprobs

    batch = uneven_batch(char_tokenizer)
    base = make_tiny_model("llama", char_tokenizer).double()
    plain, _ = grads_with_micro(copy.deepcopy(base), batch, 2)
    model = copy.deepcopy(base)
    worker = PolicyTrainer(
        model, TrainConfig(lr=1e-3, mini_batch_size=6, micro_batch_size=2), AlgorithmConfig(entropy_coef=0.05)
    )
    model.zero_grad(set_to_none=True)
    worker.accumulate_gradients(batch)
    bonus = [p.grad.detach().clone() for p in model.parameters()]
    probe = copy.deepcopy(base).train()
    _, entropy = token_logprobs(
        probe,
        batch.input_ids,
        batch.attention_mask,
        with_entropy="grad",
        target_mask=batch.response_mask,
        group_ids=batch.group_ids,
    )
    ((entropy * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    for with_bonus, without, ent in zip(bonus, plain, (p.grad for p in probe.parameters())):
        assert torch.allclose(with_bonus, without - 0.05 * ent, atol=1e-10)
    assert any(e.abs().max() > 1e-6 for e in (p.grad for p in probe.parameters()))


def grouped_batch(tokenizer) -> ExperienceBatch:
    """4 groups (prompts of 3, 5, 7, 9 tokens) of 3 samples with responses of 2..8 tokens."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 60, (3 + 2 * g,), generator=gen).tolist() for g in range(4)]
    exps = []
    for i in range(12):
        r = 2 + (i * 5) % 7
        response = torch.randint(10, 60, (r,), generator=gen).tolist()
        logprobs = (-torch.rand(r, generator=gen) * 3).tolist()
        exps.append(Experience(prompts[i // 3], response, logprobs, 0.0, float(i % 3) - 1.0, 0, group_id=i // 3))
    return ExperienceBatch.from_experiences(exps, tokenizer.pad_token_id)


def test_token_budget_packs_whole_groups_about_equally(char_tokenizer):
    from postrl.train.micro_batching import packed_tokens, token_budget_micro_batches

    batch = grouped_batch(char_tokenizer)
    # groups cost (prompt once + responses): 3+14=17, 5+17=22, 7+13=20, 9+16=25; 84 tokens
    assert packed_tokens(batch) == 84
    parts = token_budget_micro_batches(batch, 45)  # 2 micro-batches: 25+17 | 22+20
    assert [p.tolist() for p in parts] == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]
    assert [packed_tokens(batch.select(p)) for p in parts] == [42, 42]
    # a budget below a group's cost cuts the group into runs of rows, each paying its prompt
    # units: g0 [0,1]=12 [2]=8; g1 [3,4]=16 [5]=11; g2 [6,7]=13 [8]=14; g3 [9]=14 [10]=12 [11]=17
    # (row 11 alone is over the budget); 117 tokens -> 8 micro-batches, the last unit fits in none
    small = token_budget_micro_batches(batch, 16)
    assert [p.tolist() for p in small] == [[11], [3, 4], [8], [9], [6, 7], [0, 1], [10], [5], [2]]
    assert [packed_tokens(batch.select(p)) for p in small] == [17, 16, 14, 14, 13, 12, 12, 11, 8]
    # one row heavier than the budget is a micro-batch of its own
    assert [p.tolist() for p in token_budget_micro_batches(batch.select(slice(0, 3)), 4)] == [[1], [2], [0]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        token_budget_micro_batches(batch, 0)


@pytest.mark.parametrize("budget", [16, 45, 200])
def test_token_budget_split_gives_the_fixed_split_loss_and_gradients(char_tokenizer, budget):
    batch = grouped_batch(char_tokenizer)
    base = make_tiny_model("llama", char_tokenizer).double()

    def grads(loss_agg="token_mean", **train):
        model = copy.deepcopy(base)
        worker = PolicyTrainer(
            model, TrainConfig(lr=1e-3, mini_batch_size=12, **train), AlgorithmConfig(loss_agg=loss_agg)
        )
        model.zero_grad(set_to_none=True)
        sums = worker.accumulate_gradients(batch)
        return [p.grad.detach().clone() for p in model.parameters()], float(sums.value("actor/loss"))

    fixed, loss_fixed = grads(micro_batch_size=4)
    packed, loss_packed = grads(micro_batch_size=4, micro_batch_tokens=budget)
    assert abs(loss_packed - loss_fixed) < 1e-10
    largest = max(float(g.abs().max()) for g in fixed)
    assert largest > 1e-4
    assert max(float((a - b).abs().max()) for a, b in zip(fixed, packed)) < 1e-10
    if budget < 200:  # the check can fail: a per-micro-batch mean depends on the token-budget split
        naive_fixed, _ = grads("test_naive_micro_mean", micro_batch_size=12)
        naive_packed, _ = grads("test_naive_micro_mean", micro_batch_size=12, micro_batch_tokens=budget)
        assert max(float((a - b).abs().max()) for a, b in zip(naive_fixed, naive_packed)) > 1e-3 * largest
