"""The figures papers report for sampled answers: pass@k (the unbiased estimator of Chen et al.
2021, "Evaluating Large Language Models Trained on Code", eq. 1) and maj@k (majority vote over the
extracted answers). Pure functions of one prompt's samples; the harness averages them over prompts."""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n, c of them
    correct, is correct: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct samples of n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={n} samples per prompt")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def maj_at_k(answers: list[str | None], correct: list[bool], k: int) -> float:
    """Whether the majority answer of the first k samples is correct. Samples without an extracted
    answer do not vote (none voting: 0). Answers tied for the most votes are broken uniformly at
    random, so the value is the share of the tied answers that are correct (a tie of a right and a
    wrong answer gives 0.5). An answer is correct when any sample that gave it was scored correct."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers for {len(correct)} scores")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@{k} needs 1 <= k <= n={len(answers)} samples per prompt")
    votes: dict[str, int] = {}
    right: dict[str, bool] = {}
    for answer, ok in zip(answers[:k], correct[:k], strict=True):
        if answer is None:
            continue
        votes[answer] = votes.get(answer, 0) + 1
        right[answer] = right.get(answer, False) or ok
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, v in votes.items() if v == top]
    return sum(right[a] for a in tied) / len(tied)


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]
