"""What a distillation teacher is: something that gives the logprob of each token of a sequence
after a given position, or says why it could not."""

from __future__ import annotations

from typing import Protocol

from postrl.config.run import ConfigError
from postrl.types.teaching import TeacherAnswer, TeacherFailure, TeacherQuery

__all__ = ["Teacher", "TeacherAnswer", "TeacherFailure", "TeacherQuery", "TokenizerMismatchError"]


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
