"""reasoning-gym's scoring of a response, on the answer extracted from it.

The answer is extracted as the row's ``rg_answer_format`` says (``data.reasoning_gym.answer_format``):
``tags``, the text of the last ``<answer>...</answer>``; ``last_number``, the last number in the
response (commas between digits dropped). A response without one scores 0, however much of it
matches the reference. Two scorers (``scorer`` of the
``reasoning_gym`` reward component):

- ``reasoning_gym``: the task's own ``score_answer`` on the extracted answer (its partial credit
  where the task defines one), except the rule of the library's default scorer and of many tasks'
  own (``compute_decimal_reward``): ``len(reference) / len(answer)`` for an answer that merely
  contains the reference. Such an answer earns 0: a partial score for an answer that contains the
  reference is dropped;
- ``cascade``: all or nothing, and stricter: 1 when the extracted answer equals the reference
  exactly, else after collapsing whitespace and case, else as numbers (relative 1e-9), else when
  the task's own scorer gives full marks; otherwise 0. (The pinned reasoning-gym has no cascade
  scorer of its own; this is postrl's.)
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def extract_answer(response: str, answer_format: str = "tags") -> str | None:
    """The stripped text of the last ``<answer>`` tag (``tags``) or the last number (``last_number``);
    None without one."""
    if answer_format == "last_number":
        numbers = _NUMBER.findall(_THOUSANDS.sub("", response))
        return numbers[-1] if numbers else None
    found = _ANSWER.findall(response)
    return found[-1].strip() if found else None


@lru_cache(maxsize=256)
def _dataset(task: str, config_json: str) -> Any:
    """A one-problem dataset of the row's task and config: the object that holds its ``score_answer``."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=0, size=1, **json.loads(config_json))


def _own_score(task: str, config: dict[str, Any], answer: str, entry: dict[str, Any]) -> float:
    value = float(_dataset(task, json.dumps(config, sort_keys=True)).score_answer(answer, entry))
    if value < 1.0 and str(entry["answer"]).strip() in answer:
        return 0.0  # credit for containing the reference, not for being it
    return value


def _number(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _cascade(task: str, config: dict[str, Any], answer: str, entry: dict[str, Any]) -> float:
    reference = str(entry["answer"]).strip()
    if answer == reference or " ".join(answer.split()).lower() == " ".join(reference.split()).lower():
        return 1.0
    got, want = _number(answer), _number(reference)
    if got is not None and want is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
        return 1.0
    return 1.0 if _own_score(task, config, answer, entry) >= 1.0 else 0.0


def score(
    prompt: str,
    response: str,
    rg_task: str | None = None,
    rg_config: dict[str, Any] | None = None,
    rg_entry: dict[str, Any] | None = None,
    scorer: str = "reasoning_gym",
    rg_answer_format: str = "tags",
    **columns: object,
) -> float:
    """A reward function (:mod:`postrl.reward.verifiers`'s shape) for rows made by ``data.reasoning_gym``."""
    if rg_task is None or rg_entry is None:
        raise KeyError(
            "row has no 'rg_task'/'rg_entry' columns: the reasoning_gym component scores rows "
            "made by data.reasoning_gym"
        )
    answer = extract_answer(response, rg_answer_format)
    if answer is None:
        return 0.0
    if scorer == "cascade":
        return _cascade(rg_task, rg_config or {}, answer, rg_entry)
    return _own_score(rg_task, rg_config or {}, answer, rg_entry)


def _preload() -> None:
    import reasoning_gym  # noqa: F401 - the library's import (~1 s) paid before a worker reports ready


score.preload = _preload  # type: ignore[attr-defined]
