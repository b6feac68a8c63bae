"""``controller.mode: async``: the producer side of the step (sample, generate, score, prepare
advantages) runs in its own thread, ahead of training by at most ``buffer.max_staleness`` batches,
and new weights reach the rollout engines from a background thread.

The producer may start its k-th batch (counted from 1 over the whole run) once the trainer's
version is at least ``k - 1 - max_staleness``, so that the batch, trained at step k under version
``k - 1``, lags by at most ``max_staleness``; with ``buffer.on_stale: wait`` it also waits for the
engines to hold that version (nothing can go stale), with ``drop`` it generates on whatever they
hold and the buffer drops what went stale. ``max_staleness: 1`` is one-step-off training.

A checkpoint pauses the producer between two batches, so the buffer, the sampler, the engines'
generators and the unconsumed batches' reports are one consistent state: a resumed run trains
every sample once. On 2 cores the threads share the CPU: only waiting (a remote verifier, a
weight transfer) is hidden, not compute.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from postrl.controller.generated import Generated
from postrl.types import Experience


@dataclass
class ProducedBatch:
    """What the producer side says about one batch it put into the buffer: its metrics (rewards,
    lengths, its own stage timings) and notes for the console."""

    values: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)


def ledger_state(produced: int, reports: deque[ProducedBatch]) -> dict[str, Any]:
    """A producer's part of the checkpoint: batches produced in all, the reports not yet consumed."""
    return {"produced": produced, "reports": [(r.values, r.notes) for r in reports]}


def ledger_of(state: dict[str, Any]) -> tuple[int, deque[ProducedBatch]]:
    return int(state["produced"]), deque(ProducedBatch(dict(v), dict(n)) for v, n in state["reports"])


class PipelineError(RuntimeError):
    """The producer or the weight-sync thread stopped with an error (the cause is chained)."""


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
        self.push, self.on_applied, self.threads, self.on_exit = push, on_applied, threads, on_exit
        self._cv = threading.Condition()
        self._next: tuple[dict[str, torch.Tensor], int] | None = None
        self._busy, self._closed = False, False
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


@dataclass(frozen=True)
class BatchSteps:
    """What the producer thread does to make a batch: ``generate(number, resumed)`` a new batch,
    or continues ``resumed`` (one a checkpoint suspended), returning it and whatever ``finish``
    needs; ``finish(begun)`` scores and prepares it; ``suspend()`` asks the engines to stop the
    generate in progress (True when they did)."""

    generate: Callable[[int, Generated | None], tuple[Generated, Any]]
    finish: Callable[[tuple[Generated, Any]], tuple[list[Experience], ProducedBatch]]
    suspend: Callable[[], bool]


class Producer:
    """The producer thread (``overlap: generation``). ``may_start(k)`` says whether batch k may
    start now (checked under the shared condition, which the consumer and the sync thread notify
    when versions move). A checkpoint (:meth:`paused`) suspends a generation in progress: its
    rollouts so far are held as ``in_flight``, saved with the checkpoint and continued afterwards
    (after a restart too) rather than waited for."""

    def __init__(
        self,
        steps: BatchSteps,
        deliver: Callable[[list[Experience]], None],
        may_start: Callable[[int], bool],
        total: int,
        produced: int,
        cv: threading.Condition,
        threads: int = 1,
        failed: Callable[[], bool] = lambda: False,
    ) -> None:
        """``failed()``: the weight sync has stopped, so no version will arrive to wait for."""
        self.steps, self.deliver, self.may_start, self.threads = steps, deliver, may_start, threads
        self.failed = failed
        self.total, self.produced, self.cv = total, produced, cv
        self.reports: deque[ProducedBatch] = deque()
        self.in_flight: Generated | None = None  # the batch a checkpoint suspended, to continue
        self.error: BaseException | None = None
        self._paused = self._stopped = self._busy = self._exited = False
        self.waited_s = 0.0  # time the producer spent held back by the staleness bound
        self.suspended = 0  # generations a checkpoint suspended
        self._thread = threading.Thread(target=self._run, name="postrl-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def next_report(self) -> ProducedBatch:
        """The oldest unconsumed batch's report, once there is one (its experiences are in the buffer)."""
        with self.cv:
            self.cv.wait_for(lambda: self.reports or self._exited)
            if self.reports:
                return self.reports.popleft()
            if self.error is not None:
                raise PipelineError("the producer thread (generate, score) failed") from self.error
            raise PipelineError(f"the producer stopped after {self.produced} of {self.total} batches")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the producer between two batches (for a consistent checkpoint); a generation in
        progress is suspended (engines that cannot stop mid-call finish it), scoring is waited for."""
        with self.cv:
            self._paused = True
            busy = self._busy
        if busy:
            self.steps.suspend()  # outside the lock: the engines' call
        with self.cv:
            self.cv.wait_for(lambda: not self._busy)
        try:
            yield
        finally:
            with self.cv:
                self._paused = False
                self.cv.notify_all()

    def stop(self) -> None:
        """Stop after the batch in progress (if any) and wait for the thread."""
        with self.cv:
            self._stopped = True
            self.cv.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _ready(self) -> bool:
        if self._stopped or self.failed():
            return True
        if self._paused or self.produced >= self.total:
            return False
        return self.in_flight is not None or self.may_start(self.produced + 1)  # in flight: it had started

    def _run(self) -> None:
        """The thread: batches until the total or a stop; whatever ends it, the consumer is woken
        (an error is handed to it at its next step)."""
        try:
            torch.set_num_threads(self.threads)  # this thread's own OpenMP team (see controller.producer_threads)
            while self._next_batch():
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            with self.cv:
                self.error = exc
        finally:
            with self.cv:
                self._busy, self._exited = False, True
                self.cv.notify_all()

    def _next_batch(self) -> bool:
        with self.cv:
            began = time.perf_counter()
            self.cv.wait_for(self._ready)
            self.waited_s += time.perf_counter() - began
            if self._stopped or self.failed() or self.produced >= self.total:
                return False
            self._busy = True
            resumed, self.in_flight = self.in_flight, None
        begun = self.steps.generate(self.produced + 1, resumed)
        if begun[0].suspended:  # a checkpoint is waiting: hold the batch, continue it afterwards
            with self.cv:
                self.in_flight, self._busy = begun[0], False
                self.suspended += 1
                self.cv.notify_all()
            return True
        experiences, report = self.steps.finish(begun)
        with self.cv:
            self.deliver(experiences)
            self.reports.append(report)
            self.produced += 1
            self._busy = False
            self.cv.notify_all()
        return True

    def state_dict(self) -> dict[str, Any]:
        state = ledger_state(self.produced, self.reports)
        state["in_flight"] = None if self.in_flight is None else self.in_flight.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.produced, self.reports = ledger_of(state)
        held = state.get("in_flight")
        self.in_flight = None if held is None else Generated.of_state(held)


class InlineProducer:
    """``controller.overlap: scoring``: generation and the stages' compute run on the consumer's
    thread, between two updates, and only the waiting runs beside training: the batch generated
    for the next step is scored in a thread of its own while this step trains, and the weights
    travel in the background. On a machine where generation and training share the cores this is
    the faster pipeline (two threads computing at once contend for the cores and the interpreter
    lock), and it bounds the lag the same way: the next batch is generated by the weights the
    engines hold before this step's update.

    The interface is :class:`Producer`'s; the work happens inside :meth:`next_report`.
    """

    def __init__(
        self,
        begin: Callable[[int], Any],
        score: Callable[[Any], Any],
        finish: Callable[[Any, Any], tuple[list[Experience], ProducedBatch]],
        deliver: Callable[[list[Experience]], None],
        may_start: Callable[[int], bool],
        total: int,
        produced: int,
        cv: threading.Condition,
        failed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.begin, self.score, self.finish, self.deliver = begin, score, finish, deliver
        self.may_start, self.total, self.produced, self.cv, self.failed = may_start, total, produced, cv, failed
        self.reports: deque[ProducedBatch] = deque()
        self.waited_s = 0.0
        self.suspended = 0  # a checkpoint never meets a generation here: it runs between two steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="postrl-scoring")
        self._in_flight: tuple[Any, Future] | None = None

    def start(self) -> None:
        """Nothing runs ahead of the first step."""

    def next_report(self) -> ProducedBatch:
        """The next batch's report. The batch after it is generated first (then scored while this
        one trains), so a step abandoned during that generation leaves the report in place."""
        self._complete()
        if not self.reports:  # nothing ran ahead (the first step, or the first after a resume)
            self._begin()
            self._complete()
        if not self.reports:
            raise PipelineError(f"the producer has no batch left ({self.produced} of {self.total} produced)")
        self._begin()
        return self.reports.popleft()

    def _begin(self) -> None:
        number = self.produced + 1
        if self._in_flight is not None or number > self.total:
            return
        began = time.perf_counter()
        with self.cv:
            self.cv.wait_for(lambda: self.may_start(number) or self.failed())
        if self.failed():
            raise PipelineError("the background weight sync stopped")
        self.waited_s += time.perf_counter() - began
        token = self.begin(number)
        self._in_flight = (token, self._pool.submit(self.score, token))

    def _complete(self) -> None:
        """The batch being scored, finished into the buffer; it stays in flight until delivered, so
        an interrupted wait is waited out again by the next call (the checkpoint's)."""
        if self._in_flight is None:
            return
        token, scoring = self._in_flight
        experiences, report = self.finish(token, scoring.result())
        with self.cv:
            self.deliver(experiences)
            self.reports.append(report)
            self.produced += 1
            self._in_flight = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A checkpoint: the batch being scored is finished into the buffer first."""
        self._complete()
        yield

    def stop(self) -> None:
        if self._in_flight is not None:  # the run is ending: wait for the scoring, keep nothing
            self._in_flight[1].exception()
            self._in_flight = None
        self._pool.shutdown(wait=True)

    def alive(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return ledger_state(self.produced, self.reports)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.produced, self.reports = ledger_of(state)
