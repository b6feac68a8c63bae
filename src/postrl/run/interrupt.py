"""Stopping a run cleanly on Ctrl-C or SIGTERM.

The first signal asks the loop to stop after the step in progress; a second one abandons that
step (:class:`StepAbandoned` is raised where the main thread is). Handlers are installed only in
the main thread and the previous ones are put back on exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

STOP_GRACE_S = 3.0  # after a stop between steps
ABANDON_GRACE_S = 0.3  # after a second signal abandoned the step


class StepAbandoned(BaseException):
    """Raised in the main thread by a second stop signal; a BaseException so no ``except
    Exception`` in a step swallows it."""


class RunInterrupted(Exception):
    """The run stopped early on a signal; carries what to tell the user."""

    def __init__(self, message: str, signum: int, abandoned: bool = False) -> None:
        super().__init__(message)
        self.signum = signum
        self.abandoned = abandoned  # a second signal: the user wants the process gone now

    @property
    def grace_s(self) -> float:
        """How long threads still running get before the process leaves without them."""
        return ABANDON_GRACE_S if self.abandoned else STOP_GRACE_S

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    def __init__(self, echo: Callable[[str], None] | None = None) -> None:
        self.signum: int | None = None
        self.echo = echo or (lambda text: print(text, file=sys.stderr, flush=True))
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            self.echo(f"\n{name}: stopping after the current step (send it again to abandon the step)")
            return
        self.echo(f"\n{name} again: abandoning the current step")
        raise StepAbandoned(name)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


def leave_now_if_threads_hang(code: int, grace_s: float = 3.0) -> None:
    """After a stopped run: wait up to ``grace_s`` for the threads that would keep the process
    alive (non-daemon ones: a user's own pool, an executor that Python joins at exit), then, if any
    is still running, flush the output and end the process with ``code`` at once. Without this a
    thread stuck in an environment, tool or reward function holds the process after the run has
    stopped, until a third signal ends it with a traceback."""
    deadline = time.monotonic() + grace_s
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [
        t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon and t.is_alive()
    ]
    if stuck:
        print(f"leaving {len(stuck)} stuck thread(s) behind: {', '.join(sorted(stuck)[:5])}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def leave_now_if_connect_abandoned(code: int) -> None:
    """A command that stops while a ``ray.init`` runs on past its time limit ends at once with
    ``code``, its output flushed: finalizing the interpreter under Ray's connecting core aborts the
    process (:func:`postrl.scheduling.ray_cluster.connect_abandoned`), losing the exit code."""
    from postrl.scheduling.ray_cluster import connect_abandoned

    if connect_abandoned():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
