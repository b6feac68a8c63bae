"""Validation during training: held-out prompts answered greedily by the rollout engine (which
holds the current weights) and scored by the run's own reward components, every
``logging.eval_every`` steps and after the last step, reported as ``val/*`` metrics.

The main set is the prompt source's held-out set (:meth:`postrl.data.prompt_source.PromptSource.held_out`:
``data.val_files``, a built-in task's test split or generated held-out problems); ``data.val_size``
keeps the first N of them (the same ones every time). Each of ``data.eval_sets`` is validated beside it as
``val/<name>/...``. Rows that name their task (``task_type``) also give ``val/<task>/accuracy``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from postrl.config.run import RunConfig
from postrl.controller.batches import greedy_sampling
from postrl.data.dataset import PromptDataset
from postrl.data.prompt_source import PromptSource, load_eval_set
from postrl.reward.accuracy import accuracy, per_task_accuracy
from postrl.reward.columns import check_columns
from postrl.rollout.agentic.episodes import episode_metrics
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams, StepMetrics
from postrl.types.metric_names import (
    TIME_VALIDATE_S,
    VAL_ACCURACY,
    VAL_AGENT,
    VAL_PROMPTS,
    VAL_RESPONSE_LENGTH,
    VAL_REWARD_MEAN,
    VAL_UNSCORABLE,
    component_mean,
    eval_set,
)
from postrl.types.progress import phase


def load_validation_set(
    config: RunConfig, source: PromptSource, echo: Callable[[str], None] = print
) -> PromptDataset | None:
    """The main held-out prompts (:meth:`PromptSource.held_out`), checked against the reward; None
    when the run has none."""
    dataset = source.held_out(echo)
    if dataset is not None and config.scores_with_components:
        check_columns(config.reward, ((p.source, p.columns) for p in dataset.prompts))
    return dataset


def load_eval_sets(config: RunConfig, tokenizer: Any, echo: Callable[[str], None] = print) -> dict[str, PromptDataset]:
    """``data.eval_sets`` by name, each checked against the reward like the main set."""
    sets = {}
    for spec in config.data.eval_sets:
        dataset = load_eval_set(spec, config.data, tokenizer, echo)
        if config.scores_with_components:
            check_columns(config.reward, ((p.source, p.columns) for p in dataset.prompts))
        sets[spec.name] = dataset
    return sets


class HeldOutSource(Protocol):
    """What validation asks of a batch source (a :class:`BatchSource` is one): episodes or answers
    of held-out prompts, and their scores."""

    @property
    def accuracy_component(self) -> str | None: ...

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, version: int | None) -> list[Rollout]: ...

    def score(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]: ...


class Validator:
    """Scores the held-out prompts (the main set and each named one) with the run's rollout engine
    and Reward Service."""

    def __init__(
        self, config: RunConfig, dataset: PromptDataset | None, named: dict[str, PromptDataset] | None = None
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.named = named or {}
        self.sampling = greedy_sampling(config.rollout)

    def due(self, step: int) -> bool:
        every = self.config.logging.eval_every
        return bool(every) and (step % every == 0 or step == self.config.steps)

    def observe(self, metrics: StepMetrics, source: HeldOutSource, weight_version: int | None) -> None:
        """After a step: when validation is due, its metrics (and seconds) join the step's."""
        if self.due(metrics.step):
            began = time.perf_counter()
            metrics.values.update(self.run(source, weight_version))
            metrics.values[TIME_VALIDATE_S] = time.perf_counter() - began

    def run(self, source: HeldOutSource, weight_version: int | None) -> dict[str, float]:
        """Greedy answers, scored as the run scores them; an ``agent:`` run's whole episodes, one per
        prompt (the first training sample of a split episode)."""
        values: dict[str, float] = {}
        sets = ([("val", self.dataset)] if self.dataset is not None else []) + [
            (eval_set(name), dataset) for name, dataset in self.named.items()
        ]
        with phase("validation", len(sets), "held-out sets") as shown:
            for prefix, dataset in sets:
                values.update(self.run_set(dataset.prompts, source, weight_version, prefix))
                shown.advance(1)
        return values

    def run_set(
        self, prompts: list[Prompt], source: HeldOutSource, weight_version: int | None, prefix: str
    ) -> dict[str, float]:
        ran = source.generate(prompts, self.sampling, weight_version)
        rollouts = [r for r in ran if r.episode is None or r.episode.part == 0]
        results = source.score(prompts, rollouts)
        values = self.metrics(prompts, rollouts, results, source.accuracy_component)
        values.update(episode_metrics(rollouts, VAL_AGENT))
        threshold = self.config.reward.accuracy_threshold
        values.update(per_task_accuracy(prompts, rollouts, results, source.accuracy_component, threshold, "val"))
        if prefix == "val":
            return values
        return {prefix + name[len("val") :]: value for name, value in values.items()}

    def metrics(
        self, prompts: list[Prompt], rollouts: list[Rollout], results: list[RewardResult], component: str | None
    ) -> dict[str, float]:
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
