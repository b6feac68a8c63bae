"""Prompts from reasoning-gym's procedural tasks (``data.reasoning_gym``).

Each task's problems come from ``reasoning_gym.create_dataset(name, seed=..., size=..., **config)``
with a seed derived from the run's seed, the task's name and its level, so the same config gives
the same problems on every machine and on resume. A row carries what scoring needs: ``answer``,
``task_type`` (the task name: per-task metrics and ``applies_to``), and ``rg_task``,
``rg_config``, ``rg_entry`` for :mod:`postrl.reward.reasoning_gym`.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from postrl.config.reasoning_gym import GYM_EXTRA, GymTaskConfig, ReasoningGymConfig, max_level
from postrl.data.dataset import DatasetError, PromptDataset, build_prompts
from postrl.types.records import TASK_COLUMN


def _gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise DatasetError(GYM_EXTRA) from None
    return reasoning_gym


def task_config(task: GymTaskConfig, level: int | None) -> dict[str, Any]:
    """The task's config fields: the curriculum's values at ``level`` (when it has one), then the user's."""
    fields: dict[str, Any] = {}
    if level is not None:
        from reasoning_gym.factory import create_curriculum

        curriculum = create_curriculum(task.name)
        curriculum.set_global_level(level)
        generated = curriculum.generate_configuration({})
        fields = {k: v for k, v in dataclasses.asdict(generated).items() if k not in ("seed", "size")}
    return {**fields, **task.config}


def task_seed(seed: int, task: str, level: int | None) -> int:
    """A task's own seed, stable across processes and machines (not Python's salted ``hash``)."""
    return (seed * 1_000_003 + zlib.crc32(f"{task}@{level}".encode())) % (2**31)


def shares(tasks: list[GymTaskConfig], total: int) -> list[int]:
    """``total`` split by weight, largest remainders first (ties: the earlier task), summing to ``total``."""
    weight = sum(t.weight for t in tasks)
    exact = [total * t.weight / weight for t in tasks]
    counts = [int(x) for x in exact]
    order = sorted(range(len(tasks)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def problems(task: GymTaskConfig, level: int | None, seed: int, size: int) -> list[dict[str, Any]]:
    """``size`` problems of one task at one level: reasoning-gym entries (question, answer, metadata)."""
    if size == 0:
        return []
    config = task_config(task, level)
    try:
        dataset = _gym().create_dataset(task.name, seed=task_seed(seed, task.name, level), size=size, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise DatasetError(f"data.reasoning_gym task '{task.name}' config {config}: {exc}") from None
    return [dataset[i] for i in range(size)]


def _jsonable(value: Any) -> Any:
    """An entry's metadata as JSON values (tuples and sets become lists), so samples files can hold it."""
    return json.loads(json.dumps(value, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def rows(
    gym: ReasoningGymConfig, task: GymTaskConfig, level: int | None, seed: int, size: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(source, row)`` pairs in the shape :func:`postrl.data.dataset.build_prompts` reads."""
    config = task_config(task, level)
    for i, entry in enumerate(problems(task, level, seed, size)):
        instruction = gym.answer_instruction
        content = f"{entry['question']}\n\n{instruction}" if instruction else entry["question"]
        messages = [{"role": "user", "content": content}]
        if gym.system_prompt:
            messages.insert(0, {"role": "system", "content": gym.system_prompt})
        row: dict[str, Any] = {
            "answer": str(entry["answer"]),
            TASK_COLUMN: task.name,
            "rg_task": task.name,
            "rg_config": config,
            "rg_answer_format": gym.answer_format,
            "rg_entry": {
                "question": entry["question"],
                "answer": entry["answer"],
                "metadata": _jsonable(entry["metadata"]),
            },
        }
        if gym.chat_template:
            row["messages"] = messages
        else:
            row["prompt"] = "\n\n".join(m["content"] for m in messages)
        yield f"reasoning_gym:{task.name}@{level if level is not None else '-'}#{seed}:{i}", row


def build_gym_prompts(
    gym: ReasoningGymConfig,
    tokenizer: Any,
    seed: int,
    size: int,
    max_prompt_tokens: int,
    levels: dict[str, int] | None = None,
    on_bad_row: str = "error",
) -> PromptDataset:
    """``size`` problems over the tasks, split by weight, each task at its level (``levels``, else its
    own); a prompt longer than ``max_prompt_tokens`` is an error, or with ``on_bad_row="skip"`` skipped."""
    levels = levels or {}
    counts = shares(gym.tasks, size)

    def all_rows() -> Iterator[tuple[str, dict[str, Any]]]:
        for task, count in zip(gym.tasks, counts, strict=True):
            yield from rows(gym, task, levels.get(task.name, task.level), seed, count)

    return build_prompts(all_rows(), tokenizer, max_prompt_tokens=max_prompt_tokens, on_bad_row=on_bad_row)


def question_of(prompt_columns: dict[str, Any]) -> str:
    return prompt_columns["rg_entry"]["question"]


def held_out(
    gym: ReasoningGymConfig,
    tokenizer: Any,
    max_prompt_tokens: int,
    train_questions: set[str],
    on_bad_row: str = "error",
) -> tuple[PromptDataset, int]:
    """The held-out problems (``val_seed``), less any whose question is among ``train_questions``;
    and how many were dropped for that."""
    dataset = build_gym_prompts(gym, tokenizer, gym.held_out_seed, gym.val_size, max_prompt_tokens, None, on_bad_row)
    kept = [p for p in dataset.prompts if question_of(p.columns) not in train_questions]
    dropped = len(dataset.prompts) - len(kept)
    dataset.prompts = kept
    return dataset, dropped


def training_questions(gym: ReasoningGymConfig) -> set[str]:
    """Every training question the run can draw: each task's share at its level and, for a task
    with a curriculum, at every level it may reach (generated as the draw generates them)."""
    questions: set[str] = set()
    for task, count in zip(gym.tasks, shares(gym.tasks, gym.size), strict=True):
        top = max_level(task.name) if task.level is not None and gym.curriculum is not None else None
        levels: list[int | None] = list(range(top + 1)) if top is not None else [task.level]
        for level in levels:
            questions.update(str(entry["question"]) for entry in problems(task, level, gym.seed, count))
    return questions


def gym_held_out(
    gym: ReasoningGymConfig,
    tokenizer: Any,
    max_prompt_tokens: int,
    where: str,
    echo: Callable[[str], None],
    on_bad_row: str = "error",
) -> PromptDataset:
    """reasoning-gym's held-out problems, disjoint from the training ones: the run says how many it dropped."""
    dataset, dropped = held_out(gym, tokenizer, max_prompt_tokens, training_questions(gym), on_bad_row)
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
