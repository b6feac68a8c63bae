"""The records of the scoring pool (:mod:`postrl.reward.pool`): a job, the batch it came in, a
worker process with the jobs it holds, and what a job's result is."""

from __future__ import annotations

import json
import subprocess
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class JobResult:
    value: float | None
    error: str | None = None
    timed_out: bool = False
    reason: str | None = None  # why a scored sample got its score, when the function says


@dataclass
class PoolStats:
    restarts: int = 0
    timeouts: int = 0


@dataclass
class Batch:
    """The jobs of one ``submit`` call, for the hang breaker."""

    results: int = 0
    timeouts: int = 0
    broken: str | None = None  # set when the breaker has tripped: the error every remaining job gets


@dataclass
class Job:
    id: int
    payload: dict[str, Any]
    timeout_s: float
    future: Future
    batch: Batch = field(default_factory=Batch)
    key: str = ""  # jobs with the same key are siblings: the same prompt and columns
    in_queue: bool = True  # False once taken from the queue (the queue drops such entries lazily)
    holders: int = 0  # workers that hold a copy of it (one, or two after a reclaim)


def sibling_key(payload: dict[str, Any]) -> str:
    """The samples of one prompt share a key: the function, the prompt and its columns."""
    columns = json.dumps(payload.get("columns"), sort_keys=True, default=str)
    return f"{payload.get('fn')}\0{payload.get('prompt')}\0{columns}"


@dataclass
class Worker:
    proc: subprocess.Popen
    pending: deque = field(default_factory=deque)  # Jobs sent and not yet answered, in order
    started: float = 0.0  # when the head-of-line job started (the previous answer's arrival)
    buffer: bytes = b""
    outgoing: bytearray = field(default_factory=bytearray)  # job lines not yet taken by the pipe
    ready: bool = False  # the process has imported its code; only then do job timeouts run
    stderr: Any = None  # the read end of the worker's stderr pipe
    reclaimed: bool = False  # the jobs behind its stalled head went back to the queue

    keys: Counter = field(default_factory=Counter)  # the sibling keys of the jobs in pending

    def holds_sibling(self, key: str) -> bool:
        return self.keys[key] > 0

    def push(self, job: Job) -> None:
        self.pending.append(job)
        self.keys[job.key] += 1
        job.holders += 1

    def pop_head(self) -> Job:
        job = self.pending.popleft()
        self.keys[job.key] -= 1
        job.holders -= 1
        return job

    def stalled(self, now: float, after_s: float) -> bool:
        return self.ready and bool(self.pending) and now - self.started > after_s


class PoolClosedError(RuntimeError):
    """Raised for jobs submitted to, or still queued in, a closed pool."""
