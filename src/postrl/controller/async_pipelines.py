"""The async pipelines (``controller.mode: async``): :class:`ThreadedPipeline` produces in a thread of
its own, :class:`InlinePipeline` generates between two updates and scores beside training; both
push new weights from a :class:`~postrl.controller.background_sync.BackgroundSync` thread. See
:mod:`postrl.controller.pipeline`."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from postrl.config.run import RunConfig
from postrl.controller.background_sync import BackgroundSync
from postrl.controller.generated import Generated
from postrl.controller.overlap import computes_serially
from postrl.controller.pipeline import (
    Batch,
    BatchSteps,
    PipelineError,
    ProducedBatch,
    Weights,
    ledger_of,
    ledger_state,
)
from postrl.controller.step_metrics import StageTimer
from postrl.controller.versions import Versions
from postrl.types import Experience
from postrl.types.metric_names import ROLLOUT_SUSPENDED_BATCHES, TIME_PRODUCER_WAITED_S, TIME_WEIGHT_PUSH_S


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
        self.steps = steps
        self.deliver = deliver
        self.may_start = may_start
        self.threads = threads
        self.failed = failed
        self.total = total
        self.produced = produced
        self.cv = cv
        self.reports: deque[ProducedBatch] = deque()
        self.in_flight: Generated | None = None  # the batch a checkpoint suspended, to continue
        self.error: BaseException | None = None
        self._paused = self._stopped = self._busy = self._exited = False
        self.waited_s = 0.0  # time the producer spent held back by the staleness bound
        self.suspended = 0  # generations a checkpoint suspended
        self._thread = threading.Thread(target=self._run, name="postrl-producer", daemon=True)

    def start(self) -> None:
        """Start the thread (once); the first :meth:`next_report` does, after a resumed run's state is loaded."""
        if self._thread.ident is None:
            self._thread.start()

    def next_report(self) -> ProducedBatch:
        """The oldest unconsumed batch's report, once there is one (its experiences are in the buffer)."""
        self.start()
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

    def give_back(self, report: ProducedBatch) -> None:
        with self.cv:
            self.reports.appendleft(report)

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
                self._busy = False
                self._exited = True
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
        if resumed is None:
            batch = self.steps.begin(self.produced + 1, StageTimer(), alone=True)
        else:
            batch = self.steps.resume(resumed)
        if batch.generated.suspended:  # a checkpoint is waiting: hold the batch, continue it afterwards
            with self.cv:
                self.in_flight = batch.generated
                self._busy = False
                self.suspended += 1
                self.cv.notify_all()
            return True
        experiences, report = self.steps.finish(batch, self.steps.score_batch(batch))
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


class BackgroundWeights:
    """What both async pipelines share: the batch steps, the buffer's put, the versions, and new
    weights pushed from a :class:`BackgroundSync` thread (a copy, so training goes on)."""

    def __init__(
        self,
        steps: BatchSteps,
        deliver: Callable[[list[Experience]], None],
        versions: Versions,
        push: Callable[[Weights, int], None],
        config: RunConfig,
    ) -> None:
        self.steps = steps
        self.deliver = deliver
        self.versions = versions
        self.config = config
        self.syncer = BackgroundSync(push, versions.engines_hold, config.controller.producer_threads, versions.wake)

    def publish(self, state: Weights, version: int) -> None:
        self.syncer.post({k: v.detach().clone() for k, v in state.items()}, version)

    def may_start(self, batch: int) -> bool:
        return self.versions.may_start(batch, self.config.buffer)

    def sync_failed(self) -> bool:
        return self.syncer.error is not None

    def close_sync(self) -> None:
        """The last weights onto the engines, then the sync thread ends."""
        try:
            self.syncer.flush()
        finally:
            self.syncer.close()


class ThreadedPipeline(BackgroundWeights):
    """``overlap: generation``: the :class:`Producer` thread, and the weights in the background."""

    def __init__(
        self,
        steps: BatchSteps,
        deliver: Callable[[list[Experience]], None],
        versions: Versions,
        push: Callable[[Weights, int], None],
        config: RunConfig,
    ) -> None:
        super().__init__(steps, deliver, versions, push, config)
        threads = config.controller.producer_threads
        self.producer = Producer(
            steps, deliver, self.may_start, config.steps, 0, versions.cv, threads, self.sync_failed
        )

    def next_report(self, timer: StageTimer) -> ProducedBatch:
        return timer.run("wait", self.producer.next_report)

    def metrics(self) -> dict[str, float]:
        return {
            TIME_PRODUCER_WAITED_S: self.producer.waited_s,
            ROLLOUT_SUSPENDED_BATCHES: float(self.producer.suspended),
            TIME_WEIGHT_PUSH_S: self.syncer.last_s,
        }

    def give_back(self, report: ProducedBatch | None, taken: bool) -> bool:
        if taken:  # what was taken from the buffer cannot be put back
            return False
        if report is not None:
            self.producer.give_back(report)
        return True

    def paused(self) -> AbstractContextManager[None]:
        return self.producer.paused()

    def state_dict(self) -> dict[str, Any]:
        return self.producer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.producer.load_state_dict(state)

    def close(self) -> None:
        self.producer.stop()
        self.close_sync()


class InlinePipeline(BackgroundWeights):
    """``controller.overlap: scoring``: generation and the stages' compute run on the consumer's
    thread, between two updates, and only the waiting runs beside training: the batch generated
    for the next step is scored in a thread of its own while this step trains, and the weights
    travel in the background (with ``controller.serial_compute``, are pushed after the update, on
    this thread). On a machine where generation and training share the cores this is
    the faster pipeline (two threads computing at once contend for the cores and the interpreter
    lock), and it bounds the lag the same way: the next batch is generated by the weights the
    engines hold before this step's update. A checkpoint never meets a generation in progress."""

    def __init__(
        self,
        steps: BatchSteps,
        deliver: Callable[[list[Experience]], None],
        versions: Versions,
        push: Callable[[Weights, int], None],
        config: RunConfig,
    ) -> None:
        super().__init__(steps, deliver, versions, push, config)
        self.produced = 0
        self.reports: deque[ProducedBatch] = deque()
        self.waited_s = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="postrl-scoring")
        self._in_flight: tuple[Batch, Future] | None = None
        self.serial = computes_serially(config)  # resolved once: it asks torch about the devices

    def publish(self, state: Weights, version: int) -> None:
        """With serial compute (``controller.serial_compute``) the new weights are pushed now, from the
        trainer's own tensors: the update is over and the next generation runs on this thread, so no
        copy is needed and no thread computes beside the scoring. Otherwise a copy travels in the
        background."""
        if not self.serial:
            super().publish(state, version)
            return
        began = time.perf_counter()
        self.syncer.push(state, version)
        self.syncer.last_s = time.perf_counter() - began
        self.versions.engines_hold(version)

    def next_report(self, timer: StageTimer) -> ProducedBatch:
        """The next batch's report (``time/wait_s``: finishing it and generating the one after)."""
        return timer.run("wait", self._next_report)

    def _next_report(self) -> ProducedBatch:
        """The batch after this one is generated first (then scored while this one trains), so a
        step abandoned during that generation leaves the report in place."""
        self._complete()
        if not self.reports:  # nothing ran ahead (the first step, or the first after a resume)
            self._begin()
            self._complete()
        if not self.reports:
            raise PipelineError(f"the producer has no batch left ({self.produced} of {self.config.steps} produced)")
        self._begin()
        return self.reports.popleft()

    def metrics(self) -> dict[str, float]:
        return {TIME_PRODUCER_WAITED_S: self.waited_s, TIME_WEIGHT_PUSH_S: self.syncer.last_s}

    def give_back(self, report: ProducedBatch | None, taken: bool) -> bool:
        if taken:
            return False
        if report is not None:
            self.reports.appendleft(report)
        return True

    def _begin(self) -> None:
        number = self.produced + 1
        if self._in_flight is not None or number > self.config.steps:
            return
        began = time.perf_counter()
        with self.versions.cv:
            self.versions.cv.wait_for(lambda: self.may_start(number) or self.sync_failed())
        if self.sync_failed():
            raise PipelineError("the background weight sync stopped") from self.syncer.error
        self.waited_s += time.perf_counter() - began
        batch = self.steps.begin(number, StageTimer(), alone=True)
        self._in_flight = (batch, self._pool.submit(self.steps.score_batch, batch))

    def _complete(self) -> None:
        """The batch being scored, finished into the buffer; it stays in flight until delivered, so
        an interrupted wait is waited out again by the next call (the checkpoint's)."""
        if self._in_flight is None:
            return
        batch, scoring = self._in_flight
        experiences, report = self.steps.finish(batch, scoring.result())
        with self.versions.cv:
            self.deliver(experiences)
            self.reports.append(report)
            self.produced += 1
            self._in_flight = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A checkpoint: the batch being scored is finished into the buffer first."""
        self._complete()
        yield

    def state_dict(self) -> dict[str, Any]:
        return ledger_state(self.produced, self.reports)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.produced, self.reports = ledger_of(state)

    def close(self) -> None:
        try:
            if self._in_flight is not None:  # the run is ending: wait for the scoring, keep nothing
                self._in_flight[1].exception()
                self._in_flight = None
            self._pool.shutdown(wait=True)
        finally:
            self.close_sync()
