"""Held-out accuracy of a model on a built-in task (greedy decoding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from postrl.data.dataset import build_prompts
from postrl.reward.verifiers import VERIFIERS
from postrl.reward.worker import resolve
from postrl.rollout import HFRolloutWorker
from postrl.tasks import get_task, task_rows
from postrl.types import SamplingParams


@dataclass
class EvalResult:
    task: str
    accuracy: float
    correct: int
    total: int


def evaluate_model(model: torch.nn.Module, tokenizer: Any, task: str, max_tokens: int = 16, batch_size: int = 256) -> EvalResult:
    dataset = build_prompts(iter(task_rows(task, "test")), tokenizer)
    verifier = resolve(VERIFIERS[get_task(task).verifier])
    engine = HFRolloutWorker(model, tokenizer, max_batch_size=batch_size)
    was_training = model.training
    rollouts = engine.generate(dataset.prompts, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens), 0)
    model.train(was_training)
    correct = sum(
        verifier(dataset[r.prompt_index].text, r.text, **dataset[r.prompt_index].columns) >= 1.0 for r in rollouts
    )
    return EvalResult(task=task, accuracy=correct / len(rollouts), correct=int(correct), total=len(rollouts))
