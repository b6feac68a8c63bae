"""New weights pushed to the engines from a thread of their own, so that training goes on while
they load (the async pipelines of :mod:`postrl.controller.async_pipelines`): a version posted
while an older one is in transit replaces any version not yet sent, and a failure reaches the
trainer at its next post or flush."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from postrl.controller.pipeline import PipelineError


class BackgroundSync:
    """Pushes the newest weights to the engines in a thread of its own. ``post`` never blocks: a
    version posted while an older one is still in transit replaces any version not yet sent."""

    def __init__(
        self,
        push: Callable[[dict[str, torch.Tensor], int], None],
        on_applied: Callable[[int], None],
        threads: int = 1,
        on_exit: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_applied(version)``: the engines hold ``version``; ``on_exit()``: the thread ended (a
        failure included), so that whoever waits for a version stops waiting."""
        self.push = push
        self.on_applied = on_applied
        self.threads = threads
        self.on_exit = on_exit
        self._cv = threading.Condition()
        self._next: tuple[dict[str, torch.Tensor], int] | None = None
        self._busy = False
        self._closed = False
        self.error: BaseException | None = None
        self.last_s = 0.0  # how long the last push took (the engines' load, the check, the health check)
        self._thread = threading.Thread(target=self._run, name="postrl-weight-sync", daemon=True)
        self._thread.start()

    def post(self, state: dict[str, torch.Tensor], version: int) -> None:
        with self._cv:
            if self.error is not None:
                raise PipelineError("the background weight sync failed") from self.error
            self._next = (state, version)
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every posted version is on the engines."""
        with self._cv:
            self._cv.wait_for(lambda: (self._next is None and not self._busy) or self.error is not None)
            if self.error is not None:
                raise PipelineError("the background weight sync failed") from self.error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            torch.set_num_threads(self.threads)  # this thread's own OpenMP team (see controller.producer_threads)
            while self._push_next():
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer at its next post or flush
            with self._cv:
                self.error = exc
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
            self.on_exit()

    def _push_next(self) -> bool:
        with self._cv:
            self._cv.wait_for(lambda: self._next is not None or self._closed)
            if self._next is None:
                return False
            (state, version), self._next, self._busy = self._next, None, True
        began = time.perf_counter()
        self.push(state, version)
        self.last_s = time.perf_counter() - began
        self.on_applied(version)
        with self._cv:
            self._busy = False
            self._cv.notify_all()
        return True
