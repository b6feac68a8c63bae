"""Calls into user code (environments, tools, agent functions) with a time limit, on threads that
can be abandoned.

A thread cannot be killed, so a call that passes its limit is *abandoned*: its result no longer
counts, another thread takes its place (the pool keeps its size), and the stuck thread, a daemon,
neither blocks the batch nor keeps the process alive at exit. ``concurrent.futures`` pools cannot
do this: their threads are joined at exit, so one hanging environment would hold the process after
the run has stopped. A call that raises gives back its exception with a one-line reason that names
the file and line in the user's code where it was raised (:func:`describe_failure`).
"""

from __future__ import annotations

import logging
import queue
import sysconfig
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

log = logging.getLogger(__name__)

T = TypeVar("T")
_PACKAGE = str(Path(__file__).resolve().parents[2])  # src/postrl: frames of ours are not the user's
_STDLIB = sysconfig.get_paths()["stdlib"]  # nor Python's own (a contextlib frame says nothing)
_abandoned = 0
_abandoned_lock = threading.Lock()


class CallTimedOut(Exception):
    """A call passed its time limit and was abandoned."""


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What a limited call gave: its value, or the exception it raised (a CallTimedOut when it was
    abandoned), with ``seconds`` from its start."""

    value: T | None = None
    error: BaseException | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def abandoned_calls() -> int:
    """How many calls this process has abandoned (their threads may still be running)."""
    return _abandoned


def run_limited(
    calls: Sequence[Callable[[], T]], timeout_s: float | None, workers: int, what: str = "call"
) -> list[Outcome[T]]:
    """Run ``calls`` at most ``workers`` at a time, each within ``timeout_s`` seconds from its own
    start (None: no limit), and give their outcomes in order. Never raises for a call's failure.
    The wait is interruptible: a signal handler that raises in the main thread gets through."""
    global _abandoned
    outcomes: list[Outcome[T] | None] = [None] * len(calls)
    changed = threading.Condition()
    pending, running = deque(range(len(calls))), dict[int, float]()

    def work(index: int, began: float) -> None:
        try:
            outcome: Outcome[T] = Outcome(value=calls[index]())
        except BaseException as exc:  # noqa: BLE001 - the call's failure is its outcome
            outcome = Outcome(error=exc)
        with changed:
            if outcomes[index] is None:  # not abandoned meanwhile
                outcomes[index] = Outcome(outcome.value, outcome.error, time.monotonic() - began)
            changed.notify_all()

    with changed:
        while pending or running:
            now = time.monotonic()
            for index in [i for i in running if outcomes[i] is not None]:
                del running[index]
            for index, began in list(running.items()):
                if timeout_s is not None and now - began >= timeout_s:
                    error = CallTimedOut(f"{what} timed out after {timeout_s:g} s")
                    outcomes[index] = Outcome(error=error, seconds=now - began)
                    del running[index]
                    with _abandoned_lock:
                        _abandoned += 1
            while pending and len(running) < workers:
                index = pending.popleft()
                running[index] = began = time.monotonic()
                name = f"postrl-{what.replace(' ', '-')}-{index}"
                threading.Thread(target=work, args=(index, began), name=name, daemon=True).start()
            if running:
                due = min(running.values()) + timeout_s - now if timeout_s is not None else 1.0
                changed.wait(timeout=max(0.001, min(due, 1.0)))
    return [o for o in outcomes if o is not None]


def call_limited(fn: Callable[[], T], timeout_s: float | None, what: str = "call") -> T:
    """``fn()`` within ``timeout_s``; its own exception, or CallTimedOut, is raised here."""
    (outcome,) = run_limited([fn], timeout_s, 1, what)
    if outcome.error is not None:
        raise outcome.error
    return cast(T, outcome.value)


class LimitedWorker:
    """One daemon thread that runs calls one at a time, each within a time limit, for work that
    must stay on one thread (a child process started with a parent-death signal dies with the
    thread that started it, so a tool's interpreter needs a thread that outlives each call). A call
    past its limit is abandoned with its thread; the next call starts a new one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Outcome[Any]]] | None] | None = None

    def call(self, fn: Callable[[], T], timeout_s: float | None, what: str = "call") -> T:
        """``fn()`` on this worker's thread; its exception, or CallTimedOut, is raised here."""
        global _abandoned
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True).start()
        reply: queue.SimpleQueue[Outcome[Any]] = queue.SimpleQueue()
        self._jobs.put((fn, reply))
        try:
            outcome = reply.get(timeout=timeout_s)
        except queue.Empty:
            self._jobs = None  # the thread is stuck in fn: leave it, and its queue, behind
            with _abandoned_lock:
                _abandoned += 1
            raise CallTimedOut(f"{what} timed out after {timeout_s:g} s") from None
        if outcome.error is not None:
            raise outcome.error
        return cast(T, outcome.value)

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while (job := jobs.get()) is not None:
        fn, reply = job
        began = time.monotonic()
        try:
            reply.put(Outcome(value=fn(), seconds=time.monotonic() - began))
        except BaseException as exc:  # noqa: BLE001 - the call's failure is its outcome
            reply.put(Outcome(error=exc, seconds=time.monotonic() - began))


def _not_ours_nor_python_s(filename: str) -> bool:
    in_stdlib = filename.startswith(_STDLIB) and not _installed(filename)
    return not (filename.startswith(_PACKAGE) or in_stdlib or filename.startswith("<"))


def _installed(filename: str) -> bool:
    """A frame of an installed library (``site-packages``, Debian's ``dist-packages``)."""
    return any(part in ("site-packages", "dist-packages") for part in Path(filename).parts)


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """``(reason, traceback)``: the reason is one line, ``Type: message (file:line)`` with the
    innermost frame of the user's own code: outside postrl, Python's standard library and installed
    libraries (not ``contextlib.py`` nor ``openai/_base_client.py``, but the agent's line that called
    them); a failure raised wholly inside libraries names the innermost library frame. An error
    without a message that was raised from another (verifiers' ``ModelError`` from the client's
    ``BadRequestError``) goes on with that one's reason, which says what went wrong. The
    traceback is the whole one."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    outside = [f for f in traceback.extract_tb(exc.__traceback__) if _not_ours_nor_python_s(f.filename)]
    frames = [f for f in outside if not _installed(f.filename)] or outside
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if message:
        return f"{type(exc).__name__}: {message}{where}", text
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None:
        return f"{type(exc).__name__}{where} from {describe_failure(cause)[0]}", text
    return f"{type(exc).__name__}{where}", text


def failure_info(exc: BaseException, stage: str) -> dict[str, Any]:
    """An episode's ``info`` entries for a failure in ``stage`` (reset, step, close, agent): the
    error, the one-line reason the run reports (``environment step failed: KeyError: 'k'
    (envs.py:41)``, or the time-out's own message) and, for a raised error, its traceback."""
    if isinstance(exc, CallTimedOut):
        return {"env_error": str(exc), "env_reason": str(exc), "env_failed_in": stage}
    error, text = describe_failure(exc)
    who = "agent function" if stage == "agent" else f"environment {stage}"
    return {"env_error": error, "env_reason": f"{who} failed: {error}", "env_traceback": text, "env_failed_in": stage}


def log_close_failures(failures: list[str], closed: int) -> None:
    """One warning for a batch's environments whose close() failed (or timed out): how many, and
    the most common reason."""
    if failures:
        reason, count = Counter(failures).most_common(1)[0]
        log.warning("%d of %d environments' close() failed (%dx %s)", len(failures), closed, count, reason)
