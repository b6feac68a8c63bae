"""A verifiers tool environment, written as one is for prime-rl and the Environments Hub: arithmetic
problems from reasoning-gym (procedural, offline) that the model solves with add, subtract and
multiply tools, scored by a rubric (the answer's last number equals the problem's).

postrl trains on it unmodified (examples/verifiers/arith_tools.yaml):

    agent:
      verifiers: arith_tools:load_environment
      verifiers_args: {eval_size: 64}

The held-out split comes from other seeds, less any question the training split holds.
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf
from datasets import Dataset

SYSTEM = "Solve the arithmetic problem. Use the tools for every sum, difference and product; end with the number."
TASKS = [{"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}}]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract b from a.

    Args:
        a: the number to subtract from
        b: the number to subtract
    """
    return a - b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def correct_answer(completion, answer) -> float:
    """1 when the last number of the final message is the answer."""
    numbers = re.findall(r"-?\d+", completion[-1]["content"] or "") if completion else []
    return 1.0 if numbers and numbers[-1] == str(answer) else 0.0


def problems(tasks: list[dict[str, Any]], size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` problems over ``tasks`` in turn (task 0, task 1, ..., task 0, ...): any first rows
    hold every task."""
    import reasoning_gym

    made = [
        reasoning_gym.create_dataset(t["name"], seed=seed + 1000 * i, size=size // len(tasks) + 1, **t["config"])
        for i, t in enumerate(tasks)
    ]
    return [
        {"question": p["question"], "answer": str(p["answer"]), "info": {"family": tasks[k % len(tasks)]["name"]}}
        for k in range(size)
        for p in [made[k % len(tasks)][k // len(tasks)]]
    ]


def load_environment(
    tasks: list[dict[str, Any]] | None = None,
    train_size: int = 2000,
    eval_size: int = 64,
    seed: int = 0,
    max_turns: int = 4,
) -> vf.Environment:
    tasks = tasks or TASKS
    train = problems(tasks, train_size, seed)
    seen = {r["question"] for r in train}
    held = [r for r in problems(tasks, eval_size * 2, seed + 500_000) if r["question"] not in seen][:eval_size]
    rubric = vf.Rubric(funcs=[correct_answer])
    return vf.ToolEnv(
        dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(held),
        system_prompt=SYSTEM,
        tools=[add, subtract, multiply],
        max_turns=max_turns,
        rubric=rubric,
    )
