"""What a distillation teacher is: something that gives the logprob of each token of a sequence
after a given position, or says why it could not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from postrl.config.run import ConfigError


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


class Teacher(Protocol):
    """A frozen model that scores tokens. ``source`` names it in errors (a folder or a URL)."""

    source: str

    def logprobs(self, queries: list[TeacherQuery]) -> list[TeacherAnswer]:
        """One answer per query, in order; a failure of one sample does not fail the others."""
        ...

    def tokenization(self, text: str) -> list[str]:
        """How the teacher tokenizes ``text`` as a prompt: one string per token."""
        ...

    def pieces(self, ids: list[int]) -> list[str]:
        """The string of each token id, as the teacher reads it (the tokenizer check compares both
        with the student's: the same split and the same ids)."""
        ...

    def close(self) -> None: ...


class TokenizerMismatchError(ConfigError):
    """A teacher and its student do not tokenize alike (their logprobs would be of different tokens):
    a config error, reported in one line at start."""
