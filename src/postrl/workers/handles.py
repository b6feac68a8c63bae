"""A handle calls one worker's methods by name, wherever the worker lives.

The Controller's step code does not know where a worker is: an :class:`InProcessHandle` calls the
object itself, a :class:`~postrl.workers.process.ProcessHandle` a child process, and a
:class:`~postrl.scheduling.ray_scheduler.RayHandle` a Ray actor hosting the very same class. Every
call can have a timeout, and every failure names the worker.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``worker.method(*args, **kwargs)`` and return its result; raise WorkerDiedError or
        WorkerTimeoutError naming the worker when it cannot answer."""
        ...

    def call_async(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Future: ...

    def attribute(self, name: str) -> Any:
        """An attribute of the worker (read once by a client, e.g. the reward's accuracy component)."""
        ...

    def alive(self) -> bool: ...

    def kill(self) -> None:
        """End the worker at once (it is lost, or hung)."""
        ...

    def close(self) -> None:
        """Let the worker release what it holds and end; kill it if it does not."""
        ...


_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="postrl-call")


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
        self.obj, self.name, self.concurrent = obj, name, not serialized
        self._lock: threading.Lock | contextlib.nullcontext = (
            threading.Lock() if serialized else contextlib.nullcontext()
        )
        self._killed = False

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if self._killed:
            raise WorkerDiedError(f"{self.name} was stopped")
        with self._lock:
            return getattr(self.obj, method)(*args, **kwargs)

    def call_async(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(self.call(method, *args, timeout=timeout, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as from a remote worker
            future.set_exception(exc)
        return future

    def attribute(self, name: str) -> Any:
        return getattr(self.obj, name)

    def alive(self) -> bool:
        return not self._killed

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            close = getattr(self.obj, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        self.kill()  # in this process, ending the worker is closing it


def submit(fn: Any, *args: Any, **kwargs: Any) -> Future:
    """Run ``fn`` on the shared call pool (for handles whose calls block)."""
    return _POOL.submit(fn, *args, **kwargs)


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
