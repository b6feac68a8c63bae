"""What a distillation teacher is asked and answers (``algorithm.distill``): the values that cross
from the step (the Controller's distillation stage) to the run's teachers, wherever they run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TeacherQuery:
    """One sample: its prompt and response tokens, ``ids[start:]`` the response."""

    ids: list[int]
    start: int


@dataclass(frozen=True)
class TeacherFailure:
    """Why a teacher gave no logprobs for a sample (it is then unscorable, as a reward failure)."""

    reason: str


TeacherAnswer = list[float] | TeacherFailure  # the logprob of each of ids[start:], in order


@dataclass
class TeacherCounts:
    """What the teachers were asked in one step (a step's metrics)."""

    asked: dict[str, int] = field(default_factory=dict)  # per teacher: samples sent to it
    kept: int = 0  # samples answered from the kept logprobs (scored in an earlier step)
