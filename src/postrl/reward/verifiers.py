"""Verifiable reward functions: plain callables ``f(prompt, response, **columns) -> float | None``.

``None`` means "cannot score" (the sample is excluded from its group's baseline). They run in
scoring worker processes (see :mod:`postrl.reward.pool`), so a slow or hanging one can be killed.
"""

from __future__ import annotations

import re
from functools import lru_cache

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_final_answer(response: str) -> str | None:
    """The answer inside the last ``\\boxed{}``, else inside the first ``<answer>`` tag."""
    boxed = _boxed(response)
    if boxed is not None:
        return boxed.strip()
    match = _ANSWER_TAG.search(response)
    return match.group(1).strip() if match else None


def _reference(columns: dict, answer_column: str) -> str:
    if answer_column not in columns or columns[answer_column] is None:
        raise KeyError(f"row has no '{answer_column}' column to check the answer against")
    return str(columns[answer_column])


def exact_match(prompt: str, response: str, answer_column: str = "answer", **columns: object) -> float:
    """1.0 when the extracted answer equals the reference after trimming whitespace."""
    got = extract_final_answer(response)
    return 1.0 if got is not None and got == _reference(columns, answer_column).strip() else 0.0


@lru_cache(maxsize=8192)
def _parsed(latex: str) -> tuple:
    """math-verify's parse, memoised: a GRPO batch repeats each reference G times, and the
    samples of a group often give the same answer text (parse is most of math-verify's cost)."""
    from math_verify import parse

    return tuple(parse(latex))


def math_equal(prompt: str, response: str, answer_column: str = "answer", **columns: object) -> float:
    """1.0 when math-verify finds the extracted answer equivalent to the reference."""
    from math_verify import verify

    got = extract_final_answer(response)
    if got is None:
        return 0.0
    reference = _reference(columns, answer_column)
    gold = _parsed(reference if "$" in reference or "\\boxed" in reference else f"${reference}$")
    pred = _parsed(f"${got}$")
    return 1.0 if gold and pred and verify(list(gold), list(pred)) else 0.0


def _import_math_verify() -> None:
    import math_verify  # noqa: F401 - ~0.5 s of sympy/antlr imports, paid before a worker reports ready


math_equal.preload = _import_math_verify  # type: ignore[attr-defined]

VERIFIERS = {"exact_match": "postrl.reward.verifiers:exact_match", "math": "postrl.reward.verifiers:math_equal"}
