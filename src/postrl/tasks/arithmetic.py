"""The built-in verifiable task: multi-digit addition answered inside ``<answer>`` tags.

Problems are generated from a seed, so the train and held-out splits are reproducible and
disjoint. The prompt is the bare equation (``347+285=``) and a correct response is
``<answer>632</answer>``. The reward is 1 for the right number inside the tags, else 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ArithmeticProblem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b

    def carry_dropped_answer(self) -> int:
        """The sum a pupil writes who forgets every carry: each column mod 10, the top column whole."""
        da, db = str(self.a)[::-1], str(self.b)[::-1]
        width = max(len(da), len(db))
        total = 0
        for i in range(width):
            col = (int(da[i]) if i < len(da) else 0) + (int(db[i]) if i < len(db) else 0)
            total += (col if i == width - 1 else col % 10) * 10**i
        return total

    def to_row(self) -> dict:
        return {"prompt": self.prompt, "answer": str(self.answer), "task_type": "arithmetic"}


def make_splits(
    seed: int = 0, n_train: int = 5000, n_test: int = 200, digits: int = 3
) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """Disjoint train and held-out problems with operands of exactly ``digits`` digits."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    problems: list[ArithmeticProblem] = []
    space = (hi - lo + 1) ** 2
    if n_train + n_test > space:
        raise ValueError(f"n_train + n_test = {n_train + n_test} exceeds the {space} distinct problems")
    while len(problems) < n_train + n_test:
        pair = (rng.randint(lo, hi), rng.randint(lo, hi))
        if pair not in seen:
            seen.add(pair)
            problems.append(ArithmeticProblem(*pair))
    return problems[n_test:], problems[:n_test]
