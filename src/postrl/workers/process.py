"""A worker in a child process (spawned, so CUDA and torch.distributed start clean), called over a pipe.

The local scheduler uses it for the ranks of a multi-process train group. Results travel pickled
over a local pipe between processes of the same user: no trust boundary is crossed.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing as mp
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Any

from postrl.workers.errors import RemoteFailure
from postrl.workers.handles import WorkerDiedError, WorkerTimeoutError, member_of, methods_of, submit


@functools.cache
def pdeathsig_prefix() -> tuple[str, ...]:
    """The command prefix under which a program of someone else's dies with the thread that started
    it, even one SIGKILLed (``setpriv --pdeathsig KILL``); empty where setpriv lacks the option."""
    path = shutil.which("setpriv")
    if path is None:
        return ()
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return ("setpriv", "--pdeathsig", "KILL", "--") if "--pdeathsig" in usage else ()


def _serve(conn: Any, side: Any, factory: Any, args: tuple, kwargs: dict) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
    except (OSError, AttributeError):
        pass
    try:
        obj = factory(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        conn.send(("error", RemoteFailure.of(exc)))
        return
    if side is not None:  # the side lane's calls run beside the main lane's, in a thread of their own
        threading.Thread(target=_serve_calls, args=(side, obj), name="postrl-side-lane", daemon=True).start()
    conn.send(("ok", None))
    _serve_calls(conn, obj)
    if "close" in methods_of(obj):
        member_of(obj, "close")()  # a clean exit: the worker releases what it holds first


def _serve_calls(conn: Any, obj: Any) -> None:
    """Answer the calls arriving on ``conn`` until it closes or says None (the clean exit)."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        method, call_args, call_kwargs = message
        try:
            if method == ATTRIBUTE:
                conn.send(("ok", member_of(obj, call_args[0])))
            elif method == METHODS:
                conn.send(("ok", methods_of(obj)))
            else:
                conn.send(("ok", member_of(obj, method)(*call_args, **call_kwargs)))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            conn.send(("error", RemoteFailure.of(exc)))


ATTRIBUTE = "__attribute__"  # the message that reads an attribute of the worker instead of calling it
METHODS = "__methods__"  # the message that asks which methods the worker answers


class _Lane:
    """One pipe to the worker and the lock that keeps one call at a time on it."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()


class ProcessHandle:
    """``factory(*args, **kwargs)`` built in a new process; methods called by name, one at a time.

    ``side_calls``: methods that travel on a second pipe, served by a thread of their own in the
    worker, so they run beside a call in progress on the first (a rollout engine takes new weights
    or a suspend while it generates, and orders them itself); the handle is then ``concurrent``."""

    def __init__(
        self,
        name: str,
        factory: Any,
        *args: Any,
        start_timeout: float = 300.0,
        side_calls: frozenset[str] = frozenset(),
        **kwargs: Any,
    ) -> None:
        self.name = name
        self.side_calls = side_calls
        self.concurrent = bool(side_calls)
        self.in_process = False
        ctx = mp.get_context("spawn")
        main, child = ctx.Pipe()
        side, side_child = ctx.Pipe() if side_calls else (None, None)
        self.process = ctx.Process(
            target=_serve, args=(child, side_child, factory, args, kwargs), daemon=True, name=name
        )
        self.process.start()
        child.close()
        if side_child is not None:
            side_child.close()
        self._main = _Lane(main)
        self._side = _Lane(side) if side is not None else None
        self._started = False
        self._start_lock = threading.Lock()  # not a lane's: a side call need not wait behind a main call
        self._start_timeout = start_timeout

    def _receive(self, lane: _Lane, what: str, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not lane.conn.poll(0.05):
            if not self.process.is_alive() and not lane.conn.poll(0):
                raise WorkerDiedError(
                    f"{self.name} (pid {self.process.pid}) died during {what} (exit code {self.process.exitcode})"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerTimeoutError(
                    f"{self.name} (pid {self.process.pid}) did not answer {what} within {timeout:g} s"
                )
        try:
            status, value = lane.conn.recv()
        except EOFError:
            raise WorkerDiedError(f"{self.name} (pid {self.process.pid}) closed its pipe during {what}") from None
        if status == "error":
            raise value.error(self.name, what)
        return value

    def _ensure_started(self) -> None:
        with self._start_lock:
            if not self._started:
                self._receive(self._main, "start-up", self._start_timeout)
                self._started = True

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if not self._started:
            self._ensure_started()
        lane = self._side if self._side is not None and method in self.side_calls else self._main
        with lane.lock:
            try:
                lane.conn.send((method, args, kwargs))
            except (BrokenPipeError, OSError):
                raise WorkerDiedError(
                    f"{self.name} (pid {self.process.pid}) is gone (exit code {self.process.exitcode})"
                ) from None
            return self._receive(lane, method, timeout)

    def call_async(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Future:
        return submit(self.call, method, *args, timeout=timeout, **kwargs)

    def runs_beside(self, method: str) -> bool:
        return method in self.side_calls

    def attribute(self, name: str) -> Any:
        return self.call(ATTRIBUTE, name, timeout=60.0)

    def methods(self) -> frozenset[str]:
        return frozenset(self.call(METHODS, timeout=60.0))

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to close and exit; kill it if it does not (a process killed while it exits
        leaks its semaphores)."""
        try:
            self._main.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=timeout)
        self.kill()
