"""The loss and its gradient do not change with the micro-batch split (uneven token counts)."""

from __future__ import annotations

import copy

import torch

from postrl.config import AlgorithmConfig, TrainConfig
from postrl.train.worker import TrainWorker
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


def grads_with_micro(model, batch, micro: int, kl_beta: float = 0.0, ref=None) -> tuple[list[torch.Tensor], float]:
    worker = TrainWorker(
        model,
        TrainConfig(lr=1e-3, mini_batch_size=6, micro_batch_size=micro),
        AlgorithmConfig(kl_beta=kl_beta),
        ref_model=ref,
    )
    model.zero_grad(set_to_none=True)
    sums = worker.accumulate_gradients(batch)
    return [p.grad.detach().clone() for p in model.parameters()], float(sums.loss / sums.tokens)


def test_gradient_unchanged_by_micro_batch_split(char_tokenizer):
    batch = uneven_batch(char_tokenizer)
    base = make_tiny_model("llama", char_tokenizer).double()
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01)
    results = [grads_with_micro(copy.deepcopy(base), batch, m, kl_beta=0.1, ref=ref) for m in (6, 1, 4)]
    (g_full, loss_full), *others = results
    for grads, loss in others:
        assert abs(loss - loss_full) < 1e-10
        for a, b in zip(g_full, grads):
            assert torch.allclose(a, b, atol=1e-10, rtol=1e-8)


def test_naive_per_micro_batch_mean_differs(char_tokenizer):
    """Sanity check that the test above can fail: averaging per-micro-batch token means is wrong."""
    batch = uneven_batch(char_tokenizer)
    mask = batch.response_mask
    per_token = torch.arange(mask.numel(), dtype=torch.float64).reshape(mask.shape) * mask
    whole = per_token.sum() / mask.sum()
    naive = sum((per_token[i : i + 2].sum() / mask[i : i + 2].sum()) for i in range(0, 6, 2)) / 3
    assert abs(float(whole - naive)) > 1e-3
