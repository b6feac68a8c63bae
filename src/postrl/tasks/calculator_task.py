"""Multiplication too large to do in one's head, with a calculator tool (an ``agent:`` task).

The user asks ``347*28``; a right episode calls ``calculator(expression="347*28")`` (or the
Hermes ``<tool_call>`` form), reads the result and answers ``<answer>9716</answer>``. The
``calculator`` environment rewards the final answer.
"""

from __future__ import annotations

import random


def problems(
    seed: int = 0, n_train: int = 2000, n_test: int = 200
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint train and held-out (3-digit, 2-digit) pairs."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < n_train + n_test:
        pair = (rng.randint(100, 999), rng.randint(10, 99))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out[n_test:], out[:n_test]


def row(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b), "task_type": "calculator"}


def rows(split: str, seed: int) -> list[dict]:
    train, test = problems(seed)
    return [row(a, b) for a, b in (train if split == "train" else test)]
