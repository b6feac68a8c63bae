"""Built-in tasks: a seeded prompt set (train and held-out splits) plus a verifier.

Rows look like dataset rows (``prompt`` + ``answer`` + other columns), so a task feeds the same
pipeline as a JSONL file does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from postrl.tasks import arithmetic, calculator_task


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    rows: Callable[[str, int], list[dict]]  # (split, seed) -> rows
    verifier: str  # the reward component type that checks it (a key of postrl.reward.verifiers.VERIFIERS)
    environment: str | None = None  # a multi-turn task: the agent.env it runs with (not single-turn eval)


def _arithmetic_rows(split: str, seed: int) -> list[dict]:
    train, test = arithmetic.make_splits(seed=seed)
    return [p.to_row() for p in (train if split == "train" else test)]


TASKS: dict[str, Task] = {
    "arithmetic": Task(
        name="arithmetic",
        description="3-digit addition answered as <answer>N</answer>",
        rows=_arithmetic_rows,
        verifier="exact_match",
    ),
    "calculator": Task(
        name="calculator",
        description="3-digit x 2-digit multiplication with a calculator tool (run with agent.env=calculator)",
        rows=calculator_task.rows,
        verifier="exact_match",
        environment="calculator",
    ),
}

# The task's problems are fixed by this seed, independent of the run seed, so that held-out
# accuracy is always measured on the same problems.
TASK_SEED = 0


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def task_rows(name: str, split: str) -> list[tuple[str, dict]]:
    if split not in ("train", "test"):
        raise ValueError(f"unknown split '{split}' (use train or test)")
    return [(f"task:{name}:{split}:{i}", row) for i, row in enumerate(get_task(name).rows(split, TASK_SEED))]
