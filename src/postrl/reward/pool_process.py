"""A scoring process as the pool's I/O thread (:mod:`postrl.reward.pool`) handles it: started in a
session of its own with the driver's import path, written to and read from without blocking (one
JSON object a line each way), killed with its whole process group."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from postrl.reward.pool_jobs import Worker

log = logging.getLogger(__name__)


def spawn_worker(preload: tuple[str, ...]) -> Worker:
    """A new ``python -m postrl.reward.worker`` importing ``preload`` before it reports ready."""
    # the worker sees the same import path as the driver, so 'my_pkg.rewards:score' resolves alike
    path = os.pathsep.join(p or os.getcwd() for p in sys.path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "POSTRL_POOL_PID": str(os.getpid())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "postrl.reward.worker", *preload],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # all piped
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
    return Worker(proc=proc, started=time.monotonic(), stderr=proc.stderr)


def flush_worker(worker: Worker) -> None:
    """Write what the pipe takes without blocking (a stuck worker must not stall the I/O thread)."""
    pipe = worker.proc.stdin
    assert pipe is not None
    while worker.outgoing:
        try:
            n = os.write(pipe.fileno(), worker.outgoing)
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError, ValueError):
            worker.outgoing.clear()  # the worker died; the pool replaces it and re-queues its jobs
            return
        del worker.outgoing[:n]


def read_messages(worker: Worker) -> list[dict[str, Any]]:
    """The whole lines the worker has written since the last read: its ``ready`` and its answers
    (``id`` with ``value``, ``error``, ``reason``); a line that is not such a JSON object is logged
    and skipped."""
    assert worker.proc.stdout is not None
    try:
        chunk = os.read(worker.proc.stdout.fileno(), 1 << 16)
    except (BlockingIOError, ValueError, OSError):
        return []
    if not chunk:
        return []
    worker.buffer += chunk
    *lines, worker.buffer = worker.buffer.split(b"\n")
    messages = []
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            log.warning("scoring process %d wrote a line that is not JSON: %r", worker.proc.pid, line[:200])
            continue
        if isinstance(msg, dict) and ("ready" in msg or "id" in msg):
            messages.append(msg)
    return messages


def kill_worker(worker: Worker) -> None:
    """Kill a scoring process's whole process group and close its pipes."""
    try:
        os.killpg(worker.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    worker.proc.wait()
    for stream in (worker.proc.stdin, worker.proc.stdout, worker.proc.stderr):
        if stream:
            try:
                stream.close()
            except OSError:
                pass
