"""Progress of a step's long phases (a batch's generation or episodes, an update, a teacher pass, an
evaluation), as ``done / total`` units and the tokens they made.

As with :mod:`logging`, the code that does the work says how far it is and the run decides where
that goes: a phase is opened with :func:`phase` wherever the work is counted, and the reporter the
run installed (:func:`install`; the console's is :class:`postrl.run.progress.ConsoleProgress`)
shows it. With no reporter installed (a library caller, a worker process) a phase costs nothing.
Several phases may be open at once from several threads (an async run generates while it trains).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from postrl.types.records import Rollout, TokenCallback


@dataclass
class Phase:
    """One open phase: ``done`` of ``total`` ``unit`` (samples, episodes, prompts) and the tokens made
    so far; thread-safe to advance."""

    name: str
    total: int
    unit: str
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def advance(self, done: int = 0, tokens: int = 0) -> None:
        with self._lock:
            self.done += done
            self.tokens += tokens

    def token_counter(self) -> TokenCallback:
        """An engine's ``on_token`` that counts every token, and a sample done at its last."""

        def count(prompt_index: int, sample: int, token: int, logprob: float, top: Any, finish: str | None) -> None:
            self.advance(done=finish is not None, tokens=1)

        return count

    def snapshot(self) -> tuple[int, int]:
        """``(done, tokens)`` read together."""
        with self._lock:
            return self.done, self.tokens


class Reporter(Protocol):
    def opened(self, phase: Phase) -> None: ...

    def closed(self, phase: Phase) -> None: ...


_reporter: Reporter | None = None
_installed = threading.Lock()


def install(reporter: Reporter | None) -> Reporter | None:
    """Make ``reporter`` show every phase opened from now on (None: none); returns the one before."""
    global _reporter
    with _installed:
        before, _reporter = _reporter, reporter
    return before


@contextmanager
def phase(name: str, total: int, unit: str) -> Iterator[Phase]:
    """A phase of ``total`` ``unit``, shown by the installed reporter while it is open."""
    current = Phase(name, total, unit)
    reporter = _reporter
    if reporter is None:
        yield current
        return
    reporter.opened(current)
    try:
        yield current
    finally:
        reporter.closed(current)


def generated_tokens(rollouts: list[Rollout]) -> int:
    """The tokens the model generated in ``rollouts`` (an episode's tool output excluded)."""
    return sum(len(r.response_ids) if r.loss_mask is None else sum(r.loss_mask) for r in rollouts)
