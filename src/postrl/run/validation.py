"""Validation during training: held-out prompts answered greedily by the rollout engine (which
holds the current weights) and scored by the run's own reward components, every
``logging.eval_every`` steps and after the last step, reported as ``val/*`` metrics.

The main set is ``data.val_files``, the built-in task's test split when the run trains on a task,
or the held-out problems of ``data.reasoning_gym``; ``data.val_size`` keeps the first N of them
(the same ones every time). Each of ``data.eval_sets`` is validated beside it as
``val/<name>/...``. Rows that name their task (``task_type``) also give ``val/<task>/accuracy``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from postrl.config.reasoning_gym import ReasoningGymConfig
from postrl.config.run import RunConfig
from postrl.controller.batches import greedy_sampling
from postrl.controller.source import BatchSource
from postrl.data.dataset import DatasetError, PromptDataset, build_prompts, load_prompt_dataset
from postrl.data.reasoning_gym import held_out, training_questions
from postrl.reward.accuracy import accuracy, per_task_accuracy
from postrl.reward.columns import check_columns
from postrl.rollout.agentic.episodes import episode_metrics
from postrl.run.resolve import DEFAULT_MAX_PROMPT_TOKENS
from postrl.tasks import task_rows
from postrl.types import Prompt, RewardResult, Rollout, StepMetrics
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


def load_validation_set(config: RunConfig, tokenizer: Any, echo: Callable[[str], None] = print) -> PromptDataset | None:
    """The main held-out prompts, or None when the run has none (no val_files, no task, no
    reasoning-gym held-out problems)."""
    d = config.data
    options = d.prompt_options()
    if d.val_files:
        dataset = load_prompt_dataset(d.val_files, tokenizer, **options)
    elif d.task is not None:
        dataset = build_prompts(iter(task_rows(d.task, "test")), tokenizer, **options)
    elif d.reasoning_gym is not None and d.reasoning_gym.val_size:
        where = "data.reasoning_gym"
        dataset = gym_held_out(d.reasoning_gym, tokenizer, options["max_prompt_tokens"], where, echo, d.on_bad_row)
    else:
        return None
    if d.val_size is not None:
        dataset.prompts = dataset.prompts[: d.val_size]
    if config.scores_with_components:
        check_columns(config.reward, ((p.source, p.columns) for p in dataset.prompts))
    return dataset


def gym_held_out(
    gym: ReasoningGymConfig,
    tokenizer: Any,
    max_prompt_tokens: int | None,
    where: str,
    echo: Callable[[str], None],
    on_bad_row: str = "error",
) -> PromptDataset:
    """reasoning-gym's held-out problems, disjoint from the training ones: the run says how many it dropped."""
    tokens = max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS
    dataset, dropped = held_out(gym, tokenizer, tokens, training_questions(gym), on_bad_row)
    echo(
        f"{where}: {len(dataset)} held-out problems (seed {gym.held_out_seed}); {dropped} dropped as "
        "also among the training questions"
    )
    if not len(dataset) and dropped:
        raise DatasetError(f"{where}: every held-out problem is also a training problem; use other val_seed or tasks")
    if not len(dataset):
        raise DatasetError(
            f"{where}: no held-out problem is usable ({len(dataset.skipped)} skipped: {dataset.skipped[:1]})"
        )
    return dataset


def load_eval_sets(config: RunConfig, tokenizer: Any, echo: Callable[[str], None] = print) -> dict[str, PromptDataset]:
    """``data.eval_sets`` by name, each checked against the reward like the main set."""
    d, sets = config.data, {}
    options = d.prompt_options()
    for spec in d.eval_sets:
        if spec.reasoning_gym is not None:
            where = f"data.eval_sets[{spec.name}]"
            dataset = gym_held_out(
                spec.reasoning_gym, tokenizer, options["max_prompt_tokens"], where, echo, d.on_bad_row
            )
        else:
            dataset = load_prompt_dataset(spec.files, tokenizer, **options)
        if spec.size is not None:
            dataset.prompts = dataset.prompts[: spec.size]
        if config.scores_with_components:
            check_columns(config.reward, ((p.source, p.columns) for p in dataset.prompts))
        sets[spec.name] = dataset
    return sets


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

    def observe(self, metrics: StepMetrics, source: BatchSource, weight_version: int | None) -> None:
        """After a step: when validation is due, its metrics (and seconds) join the step's."""
        if self.due(metrics.step):
            began = time.perf_counter()
            metrics.values.update(self.run(source, weight_version))
            metrics.values[TIME_VALIDATE_S] = time.perf_counter() - began

    def run(self, source: BatchSource, weight_version: int | None) -> dict[str, float]:
        """Greedy answers, scored as the run scores them; an ``agent:`` run's whole episodes, one per
        prompt (the first training sample of a split episode)."""
        values: dict[str, float] = {}
        if self.dataset is not None:
            values.update(self.run_set(self.dataset.prompts, source, weight_version, "val"))
        for name, dataset in self.named.items():
            values.update(self.run_set(dataset.prompts, source, weight_version, eval_set(name)))
        return values

    def run_set(
        self, prompts: list[Prompt], source: BatchSource, weight_version: int | None, prefix: str
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
