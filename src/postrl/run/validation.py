"""Validation during training: held-out prompts answered greedily by the rollout engine (which
holds the current weights) and scored by the run's own reward components, every
``logging.eval_every`` steps and after the last step, reported as ``val/*`` metrics.

The prompts are ``data.val_files``, or the built-in task's test split when the run trains on a
task; ``data.val_size`` keeps the first N of them (the same ones every time).
"""

from __future__ import annotations

import time
from typing import Any

from postrl.config.run import RunConfig
from postrl.controller.batches import greedy_sampling
from postrl.controller.source import BatchSource
from postrl.data.dataset import PromptDataset, build_prompts, load_prompt_dataset
from postrl.reward.accuracy import accuracy
from postrl.reward.columns import check_columns
from postrl.rollout.agentic.episodes import episode_metrics
from postrl.tasks import task_rows
from postrl.types import RewardResult, Rollout, StepMetrics
from postrl.types.metric_names import (
    TIME_VALIDATE_S,
    VAL_ACCURACY,
    VAL_AGENT,
    VAL_PROMPTS,
    VAL_RESPONSE_LENGTH,
    VAL_REWARD_MEAN,
    VAL_UNSCORABLE,
    component_mean,
)


def load_validation_set(config: RunConfig, tokenizer: Any) -> PromptDataset | None:
    """The held-out prompts, or None when the run has none (no val_files, no task)."""
    d = config.data
    options = d.prompt_options()
    if d.val_files:
        dataset = load_prompt_dataset(d.val_files, tokenizer, **options)
    elif d.task is not None:
        dataset = build_prompts(iter(task_rows(d.task, "test")), tokenizer, **options)
    else:
        return None
    if d.val_size is not None:
        dataset.prompts = dataset.prompts[: d.val_size]
    if config.scores_with_components:
        check_columns(config.reward, ((p.source, p.columns) for p in dataset.prompts))
    return dataset


class Validator:
    """Scores the held-out prompts with the run's rollout engine and Reward Service."""

    def __init__(self, config: RunConfig, dataset: PromptDataset) -> None:
        self.config, self.dataset = config, dataset
        self.sampling = greedy_sampling(config.rollout)

    def due(self, step: int) -> bool:
        every = self.config.logging.eval_every
        return bool(every) and (step % every == 0 or step == self.config.steps)

    def observe(self, metrics: StepMetrics, source: BatchSource, weight_version: int | None) -> None:
        """After a step: when validation is due, its metrics (and seconds) join the step's."""
        if self.due(metrics.step):
            began = time.perf_counter()
            metrics.values.update(self.run(source, weight_version))
            metrics.values[TIME_VALIDATE_S] = time.perf_counter() - began

    def run(self, source: BatchSource, weight_version: int | None) -> dict[str, float]:
        """Greedy answers, scored as the run scores them; an ``agent:`` run's whole episodes, one per
        prompt (the first training sample of a split episode)."""
        prompts = self.dataset.prompts
        ran = source.generate(prompts, self.sampling, weight_version)
        rollouts = [r for r in ran if r.episode is None or r.episode.part == 0]
        results = source.score(prompts, rollouts)
        return {**self.metrics(rollouts, results, source.accuracy_component), **episode_metrics(rollouts, VAL_AGENT)}

    def metrics(self, rollouts: list[Rollout], results: list[RewardResult], component: str | None) -> dict[str, float]:
        prompts = self.dataset.prompts
        scored = [res.reward for res in results if res.reward is not None]
        values = {
            VAL_REWARD_MEAN: sum(scored) / len(scored) if scored else float("nan"),
            VAL_UNSCORABLE: float(len(results) - len(scored)),
            VAL_RESPONSE_LENGTH: sum(len(r.response_ids) for r in rollouts) / len(rollouts),
            VAL_PROMPTS: float(len(prompts)),
        }
        acc = accuracy(results, component, self.config.reward.accuracy_threshold)
        if acc is not None:
            values[VAL_ACCURACY] = acc
        for comp in sorted({k for res in results for k in res.components}):
            vals = [res.components[comp] for res in results if comp in res.components]
            values[component_mean(comp, "val")] = sum(vals) / len(vals)
        return values
