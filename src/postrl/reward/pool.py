"""A pool of killable scoring processes with a per-sample timeout.

Jobs are spread over ``num_workers`` subprocesses (``python -m postrl.reward.worker``) that each
answer their jobs in order. When a worker spends longer than ``timeout_s`` on one job it is
killed (its whole process group) and replaced; that job is reported as timed out and the
worker's remaining jobs go to the replacement. Results come back in job order.

Why processes and not threads: a Python function cannot be stopped from another thread, and
math-verify's own timeouts rely on signals, which only work in a process's main thread.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class JobResult:
    value: float | None
    error: str | None = None
    timed_out: bool = False


@dataclass
class _Worker:
    proc: subprocess.Popen
    pending: deque = field(default_factory=deque)  # job ids sent and not yet answered, in order
    started: float = 0.0  # when the head-of-line job started (the previous answer's arrival)
    buffer: bytes = b""
    ready: bool = False  # the process has started and imported its code; only then does the timeout run


class ScoringPool:
    def __init__(
        self, num_workers: int = 2, timeout_s: float = 5.0, startup_timeout_s: float = 60.0, preload: tuple[str, ...] = ()
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers, self.timeout_s, self.startup_timeout_s = num_workers, timeout_s, startup_timeout_s
        self.restarts = 0
        self.preload = preload  # functions imported before a worker reports ready
        self._workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]

    def _spawn(self) -> _Worker:
        # the worker sees the same import path as the driver, so 'my_pkg.rewards:score' resolves alike
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        proc = subprocess.Popen(
            [sys.executable, "-m", "postrl.reward.worker", *self.preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        return _Worker(proc=proc)

    def _kill(self, worker: _Worker) -> None:
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.proc.wait()
        for stream in (worker.proc.stdin, worker.proc.stdout):
            if stream:
                stream.close()

    def _send(self, worker: _Worker, jobs: list[dict[str, Any]]) -> None:
        if not jobs:
            return
        if not worker.pending:
            worker.started = time.monotonic()
        worker.pending.extend(job["id"] for job in jobs)
        payload = "".join(json.dumps(job) + "\n" for job in jobs).encode()
        assert worker.proc.stdin is not None
        worker.proc.stdin.write(payload)
        worker.proc.stdin.flush()

    def map(self, jobs: list[dict[str, Any]]) -> list[JobResult]:
        """Score jobs (dicts with fn, prompt, response, columns, options); results in job order."""
        jobs = [{**job, "id": i} for i, job in enumerate(jobs)]
        results: dict[int, JobResult] = {}
        by_id = {job["id"]: job for job in jobs}
        self._workers = [w if w.proc.poll() is None else self._restart(w) for w in self._workers]
        for w, worker in enumerate(self._workers):
            self._send(worker, jobs[w :: self.num_workers])
        selector = selectors.DefaultSelector()
        for worker in self._workers:
            selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
        try:
            while len(results) < len(jobs):
                now = time.monotonic()
                busy = [w for w in self._workers if w.pending]
                wait = min(max(0.0, w.started + self._limit(w) - now) for w in busy)
                for key, _ in selector.select(timeout=wait):
                    self._read(key.data, results)
                now = time.monotonic()
                for i, worker in enumerate(self._workers):
                    dead = worker.proc.poll() is not None and worker.pending
                    if worker.pending and (dead or now - worker.started > self._limit(worker)):
                        selector.unregister(worker.proc.stdout)
                        self._workers[i] = self._replace(worker, results, by_id, died=bool(dead))
                        selector.register(self._workers[i].proc.stdout, selectors.EVENT_READ, self._workers[i])
        finally:
            selector.close()
        return [results[i] for i in range(len(jobs))]

    def _read(self, worker: _Worker, results: dict[int, JobResult]) -> None:
        chunk = os.read(worker.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            return
        worker.buffer += chunk
        *lines, worker.buffer = worker.buffer.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if "ready" in msg:
                worker.ready = True
                worker.started = time.monotonic()
                continue
            if worker.pending and worker.pending[0] == msg["id"]:
                worker.pending.popleft()
            results[msg["id"]] = JobResult(value=msg["value"], error=msg["error"])
            worker.started = time.monotonic()

    def _limit(self, worker: _Worker) -> float:
        return self.timeout_s if worker.ready else self.startup_timeout_s

    def _replace(self, worker: _Worker, results: dict[int, JobResult], by_id: dict, died: bool) -> _Worker:
        culprit = worker.pending.popleft()
        if not worker.ready and not died:
            results[culprit] = JobResult(None, f"scoring process did not start within {self.startup_timeout_s:g}s")
        elif died:
            results[culprit] = JobResult(None, f"scoring process died (exit code {worker.proc.returncode})")
        else:
            results[culprit] = JobResult(None, f"timed out after {self.timeout_s:g}s", timed_out=True)
        self._kill(worker)
        self.restarts += 1
        fresh = self._spawn()
        self._send(fresh, [by_id[j] for j in worker.pending if j not in results])
        return fresh

    def _restart(self, worker: _Worker) -> _Worker:
        self._kill(worker)
        self.restarts += 1
        return self._spawn()

    def close(self) -> None:
        for worker in self._workers:
            self._kill(worker)
        self._workers = []

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
