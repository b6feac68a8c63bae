"""Errors that keep their type across a worker boundary.

A worker in a child process or a Ray actor sends back the qualified name of what it raised, the
message and the traceback. On the caller's side a class registered with :func:`remote_error` is
raised again as itself (``except WeightSyncError`` works wherever the engine lives); anything else
arrives as :class:`WorkerCallError` with the worker's traceback.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

REMOTE_ERRORS: dict[str, type[Exception]] = {}


class WorkerCallError(RuntimeError):
    """A method raised inside the worker; the message carries the worker's traceback."""


def remote_error(cls: type[Exception]) -> type[Exception]:
    """Class decorator: this error is raised again as its own type on the caller's side."""
    REMOTE_ERRORS[qualified_name(cls)] = cls
    return cls


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class RemoteFailure:
    """What a worker sends back instead of a result when its method raised (plain data: it crosses
    pipes and Ray's object store)."""

    kind: str
    message: str
    trace: str

    @staticmethod
    def of(exc: BaseException) -> RemoteFailure:
        return RemoteFailure(qualified_name(type(exc)), str(exc), traceback.format_exc())

    def error(self, worker: str, method: str) -> Exception:
        """The exception to raise on the caller's side, naming the worker and the call."""
        cls = REMOTE_ERRORS.get(self.kind)
        if cls is not None:
            return cls(f"{worker} in {method}: {self.message}")
        return WorkerCallError(f"{worker} failed in {method}:\n{self.trace}")
