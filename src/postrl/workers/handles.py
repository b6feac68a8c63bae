"""A handle calls one worker's methods by name, wherever the worker lives.

The Controller's step code does not know where a worker is: an :class:`InProcessHandle` calls the
object itself, a :class:`~postrl.workers.process.ProcessHandle` a child process, and a
:class:`~postrl.scheduling.ray_actors.RayHandle` a Ray actor hosting the very same class. Every
call can have a timeout, and every failure names the worker.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from typing import Any, Protocol


class WorkerDiedError(RuntimeError):
    """A worker's process ended while it was being called (or before)."""


class PlacementError(RuntimeError):
    """A scheduler could not place or start a worker; the message names the resource that is short."""


class WorkerTimeoutError(TimeoutError):
    """A worker did not answer a call within its timeout."""


class Handle(Protocol):
    name: str
    concurrent: bool  # a call may run beside one in progress (the worker orders its own calls)
    in_process: bool  # the worker is an object of this process: arguments pass as they are, callbacks included

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``worker.method(*args, **kwargs)`` and return its result; raise WorkerDiedError or
        WorkerTimeoutError naming the worker when it cannot answer."""
        ...

    def call_async(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Future: ...

    def runs_beside(self, method: str) -> bool:
        """Whether a call of ``method`` runs while another call is in progress (else it waits for it)."""
        ...

    def attribute(self, name: str) -> Any:
        """An attribute of the worker (read once by a client, e.g. the reward's accuracy component)."""
        ...

    def methods(self) -> frozenset[str]:
        """The methods the worker answers (a client checks its role's against them when it is made)."""
        ...

    def alive(self) -> bool: ...

    def kill(self) -> None:
        """End the worker at once (it is lost, or hung)."""
        ...

    def close(self) -> None:
        """Let the worker release what it holds and end; kill it if it does not."""
        ...


class WorkerHost:
    """What runs in a worker's own process (a child process, a Ray actor) when the worker needs more
    than its role's methods there: the host builds the worker (``target``) and adds its own calls
    (joining a process group, receiving a broadcast); every other call goes to the worker itself,
    so a host has no forwarders to keep in step with the role."""

    target: Any


def member_of(obj: Any, name: str) -> Any:
    """``obj.name``, where ``obj`` is the object a handle calls: a host's own member, else its worker's."""
    if isinstance(obj, WorkerHost) and not hasattr(type(obj), name):
        return getattr(obj.target, name)
    return getattr(obj, name)


def methods_of(obj: Any) -> frozenset[str]:
    """The public methods (and ``__len__``) of the object a handle calls, with its worker's for a host."""
    kind = type(obj)
    names = {n for n in dir(kind) if (not n.startswith("_") or n == "__len__") and callable(getattr(kind, n, None))}
    if isinstance(obj, WorkerHost):
        names |= methods_of(obj.target)
    return frozenset(names)


class InProcessHandle:
    """The worker object itself, called in this process (the local scheduler's handle). Calls to one
    worker run one at a time, as they would in an actor.

    A call here cannot be abandoned, so ``timeout`` does not apply. ``call_async`` runs the call at
    once, in the calling thread, and returns a finished future: the
    worker shares this process's cores anyway, and torch work started from a second thread gets a
    second OpenMP thread team whose idle spinning slowed a CPU step by half."""

    def __init__(self, obj: Any, name: str, serialized: bool = True) -> None:
        """``serialized=False``: the worker orders its own calls (a rollout engine takes new weights
        from another thread while it generates, see the native engine)."""
        self.obj = obj
        self.name = name
        self.concurrent = not serialized
        self.in_process = True
        self._lock: threading.Lock | contextlib.nullcontext = (
            threading.Lock() if serialized else contextlib.nullcontext()
        )
        self._killed = False

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if self._killed:
            raise WorkerDiedError(f"{self.name} was stopped")
        with self._lock:
            return member_of(self.obj, method)(*args, **kwargs)

    def call_async(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(self.call(method, *args, timeout=timeout, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as from a remote worker
            future.set_exception(exc)
        return future

    def runs_beside(self, method: str) -> bool:
        return self.concurrent

    def attribute(self, name: str) -> Any:
        return member_of(self.obj, name)

    def methods(self) -> frozenset[str]:
        return methods_of(self.obj)

    def alive(self) -> bool:
        return not self._killed

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            if "close" in methods_of(self.obj):
                member_of(self.obj, "close")()

    def close(self) -> None:
        self.kill()  # in this process, ending the worker is closing it


def submit(fn: Any, *args: Any, **kwargs: Any) -> Future:
    """Run ``fn`` in a daemon thread of its own (for handles whose calls block). Not a pool: a pool's
    idle threads are joined at exit, and one blocked on a hung worker would hold a stopped run's
    process open (every remote call has its own timeout)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            future.set_exception(exc)

    threading.Thread(target=run, name="postrl-call", daemon=True).start()
    return future


def gather(futures: list[Future], names: list[str], timeout: float | None = None) -> list[Any]:
    """All results, in order; the first failure is raised (its message names the worker) once every
    call has ended, so no call is left running against a worker that is being torn down."""
    results: list[Any] = []
    first: BaseException | None = None
    for future, _name in zip(futures, names):
        try:
            results.append(future.result(timeout=timeout))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
            if first is None:
                first = exc
            results.append(None)
    if first is not None:
        raise first
    return results
