"""A pool of killable scoring processes with a per-sample timeout, safe to share between threads.

Jobs are queued and handed to ``num_workers`` subprocesses (``python -m postrl.reward.worker``),
at most ``pipeline_depth`` at a time per worker, each worker answering its jobs in order. A job's
clock starts when it reaches the head of its worker's line; when it runs past its timeout the
worker is killed (its whole process group) and replaced, that job is reported as timed out and
the worker's other jobs go back to the front of the queue. Callers get futures, or ``map``'s
results in job order. One I/O thread owns the processes, so any number of threads (an HTTP
server's request handlers) may submit concurrently.

Hangs overlap instead of queueing: a worker whose current job has run past ``stall_after_s`` no
longer counts toward ``num_workers``, so another worker starts for the queued jobs (up to
``max_workers`` processes; surplus workers retire when idle). A few hanging samples therefore
cost about one timeout, not one timeout each. A hang is nearly always caused by the prompt or its
answer, so the samples of one prompt (the same prompt text and columns: its *siblings*) hang
together. Three rules keep a whole hanging group at about one timeout: siblings are never
pipelined behind one another on a worker; the jobs waiting behind a stalled job go back to the
queue (the stalled worker keeps its copies, and whichever copy answers first counts); and when a
job stalls, a worker is started for each of its queued siblings at once. When a batch (one
``submit`` call) has had ``hang_limit`` timeouts and not one result, its remaining jobs fail at
once, naming the function: a reward that always hangs stops the step in about one timeout.

Workers die with the pool: they are started by the I/O thread with a parent-death signal (Linux)
and also exit when their parent process goes away; their stderr (what reward functions print)
is collected into a log file (:meth:`ScoringPool.set_log_file`).

Why processes and not threads: a Python function cannot be stopped from another thread, and
math-verify's own timeouts rely on signals, which only work in a process's main thread.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from postrl.reward.pool_jobs import (
    Batch,
    Job,
    JobResult,
    PoolClosedError,
    PoolStats,
    Worker,
    sibling_key,
)
from postrl.reward.pool_process import flush_worker, kill_worker, read_messages, spawn_worker
from postrl.reward.worker_log import WorkerLog

log = logging.getLogger(__name__)


class ScoringPool:
    DISPATCH_WINDOW = 256  # queued jobs looked past (siblings of busy workers) for one a worker may take

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        startup_timeout_s: float = 60.0,
        preload: tuple[str, ...] = (),
        pipeline_depth: int = 4,
        max_workers: int | None = None,
        stall_after_s: float = 0.25,
        hang_limit: int = 4,
        log_file: str | os.PathLike | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if pipeline_depth < 1:
            raise ValueError("pipeline_depth must be >= 1")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.max_workers = max(num_workers, max_workers if max_workers is not None else 8 * num_workers)
        self.stall_after_s = stall_after_s
        self.hang_limit = hang_limit
        self.pipeline_depth = pipeline_depth
        self.log = WorkerLog()  # what the workers write to stderr
        if log_file is not None:
            self.set_log_file(log_file)
        self.preload = preload  # functions imported before a worker reports ready
        self.stats = PoolStats()
        self._queue: deque[Job] = deque()
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False  # no more jobs (close() was called, or the I/O thread failed)
        self._shut_down = False  # close() has run: processes killed, pipes closed
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers: list[Worker] = []  # started by the I/O thread, so they die with it
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="postrl-scoring-pool", daemon=True)
        self._thread.start()
        self._started.wait()

    # -- public ---------------------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        return self.stats.restarts

    @property
    def in_flight(self) -> int:
        with self._lock:
            jobs = {id(j): j for j in self._queue if j.in_queue}
            jobs.update((id(j), j) for w in self._workers for j in w.pending)
            return sum(not j.future.done() for j in jobs.values())

    @property
    def num_processes(self) -> int:
        with self._lock:
            return len(self._workers)

    def set_log_file(self, path: str | os.PathLike | Any) -> None:
        """Append what the workers write to stderr (reward functions' prints) to ``path``, or to an
        open binary stream (a server passes its own stderr)."""
        self.log.set_file(path)

    def submit(self, jobs: list[dict[str, Any]]) -> list[Future]:
        """Queue jobs (dicts with fn, prompt, response, columns, options and optionally timeout_s)."""
        futures: list[Future] = []
        batch = Batch()
        with self._lock:
            if self._closed:
                raise PoolClosedError("the scoring pool is closed")
            for payload in jobs:
                future: Future = Future()
                timeout = float(payload.get("timeout_s") or self.timeout_s)
                self._queue.append(Job(self._next_id, payload, timeout, future, batch, sibling_key(payload)))
                self._next_id += 1
                futures.append(future)
        self._wake()
        return futures

    def map(self, jobs: list[dict[str, Any]]) -> list[JobResult]:
        """Score jobs and wait; results in job order."""
        return [f.result() for f in self.submit(jobs)]

    def close(self) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self._closed = True
        self._wake()
        self._thread.join(timeout=30)
        for worker in self._workers:
            kill_worker(worker)
        self._workers = []
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.log.close()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the wake-up pipe ------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the pool is closing)

    # -- the I/O thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        failure: BaseException | None = None
        try:
            with self._lock:
                for _ in range(self.num_workers):
                    self._add_worker(selector)
            self._started.set()
            while True:
                with self._lock:
                    if self._closed:
                        break
                    self._scale(selector)
                    self._dispatch()
                    wait = self._next_deadline()
                    if any(w.outgoing for w in self._workers):
                        wait = 0.005 if wait is None else min(wait, 0.005)
                for key, _ in selector.select(timeout=wait):
                    if key.data is None:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif isinstance(key.data, tuple):
                        self.log.read(key.data[1].stderr)
                    else:
                        self._read(key.data)
                with self._lock:
                    self._reap(selector)
        except BaseException as exc:  # never leave callers waiting on futures nobody will resolve
            failure = exc
            log.exception("the scoring pool's I/O thread failed")
        finally:
            self._started.set()
            selector.close()
            with self._lock:
                self._closed = True
                leftovers = [job for job in self._queue if job.in_queue] + [
                    job for w in self._workers for job in w.pending
                ]
                self._queue.clear()
            reason = (
                f"the scoring pool stopped: {failure!r}"
                if failure
                else "the scoring pool was closed before this job ran"
            )
            for job in leftovers:
                if not job.future.done():
                    job.future.set_exception(PoolClosedError(reason))

    def _add_worker(self, selector: selectors.BaseSelector) -> None:
        worker = spawn_worker(self.preload)
        self._workers.append(worker)
        selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
        selector.register(worker.stderr, selectors.EVENT_READ, ("stderr", worker))

    def _remove_worker(self, worker: Worker, selector: selectors.BaseSelector) -> None:
        for stream in (worker.proc.stdout, worker.stderr):
            try:
                selector.unregister(stream)
            except (KeyError, ValueError):
                pass
        self.log.drain(worker.stderr)
        kill_worker(worker)
        while worker.pending:
            worker.pop_head()
        self._workers.remove(worker)

    def _scale(self, selector: selectors.BaseSelector) -> None:
        """Start workers while stalled ones hold the queue up (one more for each queued sibling of a
        stalled job: it will likely hang too); retire idle surplus workers."""
        now = time.monotonic()
        stalled = [w for w in self._workers if w.stalled(now, self.stall_after_s)]
        hanging = {w.pending[0].key for w in stalled}
        # a worker running a sibling of a hanging job will likely stall too: it is not counted healthy
        healthy = sum(w not in stalled and not (w.pending and w.pending[0].key in hanging) for w in self._workers)
        self._reclaim(stalled)
        if self._has_queued():
            suspects = self._suspects_first(hanging) if hanging else 0
            while healthy < self.num_workers + suspects and len(self._workers) < self.max_workers:
                self._add_worker(selector)
                healthy += 1
        elif len(self._workers) > self.num_workers:
            for worker in [w for w in self._workers if not w.pending and w.ready]:
                if len(self._workers) <= self.num_workers:
                    break
                self._remove_worker(worker, selector)

    def _suspects_first(self, hanging: set[str]) -> int:
        """Move the queued siblings of hanging jobs to the front of the queue (they likely hang too:
        the sooner each reaches a worker's head, the sooner its timeout runs out); how many there are."""
        suspects = [j for j in self._queue if j.in_queue and j.key in hanging and not j.future.done()]
        if suspects:
            chosen = {id(j) for j in suspects}
            self._queue = deque([*suspects, *(j for j in self._queue if id(j) not in chosen)])
        return len(suspects)

    def _has_queued(self) -> bool:
        """Whether a job waits in the queue (entries taken or answered meanwhile are dropped here)."""
        while self._queue and (not self._queue[0].in_queue or self._queue[0].future.done()):
            self._queue.popleft().in_queue = False
        return bool(self._queue)

    def _reclaim(self, stalled: list[Worker]) -> None:
        """The jobs waiting behind a stalled job go back to the front of the queue, for other workers.
        The stalled worker keeps its copies (they are already in its pipe): whichever copy answers
        first sets the result, and when the worker reaches a copy still queued it takes it back."""
        for worker in stalled:
            if worker.reclaimed:
                continue
            worker.reclaimed = True
            for job in reversed(list(worker.pending)[1:]):
                if not job.in_queue and not job.future.done():
                    job.in_queue = True
                    self._queue.appendleft(job)

    def _dispatch(self) -> None:
        now = time.monotonic()
        # while a job hangs, one job per worker: a job queued behind a hanging one (another prompt
        # that hangs) would only start its clock once the hang is found, a stall later
        depth = 1 if any(w.stalled(now, self.stall_after_s) for w in self._workers) else self.pipeline_depth
        open_workers = [w for w in self._workers if not w.stalled(now, self.stall_after_s) and len(w.pending) < depth]
        window = 0
        i = 0
        while open_workers and i < len(self._queue) and window < self.DISPATCH_WINDOW:
            job = self._queue[i]
            if not job.in_queue or job.future.done():  # taken by a worker meanwhile, or answered by a copy
                job.in_queue = False
                del self._queue[i]
                continue
            if job.batch.broken is not None:  # the batch's function hangs on everything: fail fast
                del self._queue[i]
                job.in_queue = False
                job.future.set_result(JobResult(None, job.batch.broken))
                continue
            # siblings are never queued behind one another: if one hangs, the others would wait it out
            eligible = [w for w in open_workers if not w.holds_sibling(job.key)]
            if not eligible:
                i += 1
                window += 1
                continue
            worker = min(eligible, key=lambda w: len(w.pending))
            del self._queue[i]
            job.in_queue = False
            if not worker.pending:
                worker.started = time.monotonic()
            worker.push(job)
            if len(worker.pending) >= depth:
                open_workers.remove(worker)
            worker.outgoing += (json.dumps({**job.payload, "id": job.id}) + "\n").encode()
        for worker in self._workers:
            flush_worker(worker)

    def _limit(self, worker: Worker) -> float:
        if not worker.ready:
            return self.startup_timeout_s
        return worker.pending[0].timeout_s

    def _next_deadline(self) -> float | None:
        """Seconds until a job's timeout or until a busy worker counts as stalled, when that matters:
        jobs are queued (another worker should start) or wait behind its head (they go back to the
        queue; without this wake-up they would wait out the head's whole timeout)."""
        busy = [w for w in self._workers if w.pending]
        if not busy:
            return None
        now = time.monotonic()
        times = [w.started + self._limit(w) - now for w in busy]
        queued = self._has_queued()
        times += [
            w.started + self.stall_after_s - now
            for w in busy
            if w.ready and not w.stalled(now, self.stall_after_s) and (queued or len(w.pending) > 1)
        ]
        return max(0.0, min(times)) + 0.001

    def _read(self, worker: Worker) -> None:
        messages = read_messages(worker)
        done: list[tuple[Job, JobResult]] = []
        with self._lock:
            for msg in messages:
                if "ready" in msg:
                    worker.ready = True
                    worker.started = time.monotonic()
                    continue
                if not worker.pending or worker.pending[0].id != msg["id"]:
                    log.warning("scoring process %d answered job %r out of turn; ignored", worker.proc.pid, msg["id"])
                    continue
                job = worker.pop_head()
                worker.started = time.monotonic()
                if worker.pending and worker.pending[0].in_queue:  # a reclaimed copy still queued: run it here
                    worker.pending[0].in_queue = False
                if not job.future.done():  # done when its batch was abandoned, or another copy answered
                    job.batch.results += 1
                    done.append(
                        (job, JobResult(value=msg.get("value"), error=msg.get("error"), reason=msg.get("reason")))
                    )
        for job, result in done:
            job.future.set_result(result)

    def _reap(self, selector: selectors.BaseSelector) -> None:
        """Replace workers that died or ran past a job's timeout (called with the lock held)."""
        now = time.monotonic()
        for worker in list(self._workers):
            dead = worker.proc.poll() is not None
            overdue = bool(worker.pending) and now - worker.started > self._limit(worker)
            abandoned = bool(worker.pending) and worker.pending[0].batch.broken is not None
            if not (dead or overdue or abandoned):
                continue
            self.stats.restarts += 1  # counted before any result is set: a caller may read it right after
            if worker.pending:
                culprit = worker.pop_head()
                fn = culprit.payload.get("fn", "the reward function")
                if culprit.future.done() or culprit.holders > 0 or culprit.in_queue:
                    result = None  # another copy answered, is running, or will run: this one just ends
                elif abandoned:
                    result = JobResult(None, culprit.batch.broken)
                elif dead:
                    result = JobResult(None, f"scoring process died (exit code {worker.proc.returncode}) in {fn}")
                elif not worker.ready:
                    result = JobResult(None, f"scoring process did not start within {self.startup_timeout_s:g}s")
                else:
                    self.stats.timeouts += 1
                    result = JobResult(None, f"{fn} timed out after {culprit.timeout_s:g}s", timed_out=True)
                    self._count_timeout(culprit, fn)
                if result is not None and not culprit.future.done():
                    culprit.future.set_result(result)
                # the jobs behind it start again elsewhere, unless a copy is queued or running already
                again = [
                    job for job in worker.pending if not job.future.done() and not job.in_queue and job.holders == 1
                ]
                for job in reversed(again):
                    job.in_queue = True
                    self._queue.appendleft(job)
            self._remove_worker(worker, selector)
            if len(self._workers) < self.num_workers:
                self._add_worker(selector)

    def _count_timeout(self, job: Job, fn: str) -> None:
        """Trip the batch's breaker when its function has only ever timed out."""
        batch = job.batch
        batch.timeouts += 1
        if batch.broken is None and batch.results == 0 and batch.timeouts >= self.hang_limit:
            batch.broken = (
                f"not run: {fn} timed out on {batch.timeouts} samples of this batch and returned "
                f"on none (after {job.timeout_s:g}s each)"
            )
            for worker in self._workers:  # jobs of the batch waiting behind other jobs: answer now, skip later
                for queued in list(worker.pending)[1:]:
                    if queued.batch is batch and not queued.future.done():
                        queued.future.set_result(JobResult(None, batch.broken))
