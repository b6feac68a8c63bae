"""Benchmarks that compare frameworks step by step: each framework runs in a process of its own
(its memory and threads are its own) and takes one step each time the parent lets it, so a slow
phase of the shared machine hits every framework alike. The worker prints one marked JSON line per
step and waits for a line on stdin (``go``, or ``stop`` where the parent ends the run early); the
parent rotates the order every round."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MARK = "@@step "  # the lines of the worker protocol on stdout (the frameworks print too)
STOP = "stop"


def wait_for_turn(**reply: object) -> float:
    """A worker's step is done: report it, wait until the parent says go (another framework's step
    runs meanwhile), and return the time the next step starts."""
    return turn(**reply) or time.perf_counter()


def turn(**reply: object) -> float | None:
    """As :func:`wait_for_turn`, or None where the parent says stop: the worker ends its run after
    this step and replies once more, with ``"last": true``."""
    print(MARK + json.dumps(reply), flush=True)
    said = sys.stdin.readline().strip()
    return None if said == STOP else time.perf_counter()


class Worker:
    """One framework's run in a process of its own (``command``). A thread drains its stdout, so
    that what the framework prints never fills the pipe while another framework runs."""

    def __init__(self, framework: str, command: list[str]) -> None:
        self.framework = framework
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.replies: queue.Queue[dict | None] = queue.Queue()
        self.done = False
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.replies.put(json.loads(line[len(MARK) :]))
        self.replies.put(None)

    def reply(self) -> dict:
        got = self.replies.get()
        if got is None:
            raise RuntimeError(f"the {self.framework} worker exited ({self.proc.wait()}) before it replied")
        return got

    def go(self, word: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()


def run_interleaved(
    commands: dict[str, list[str]],
    rounds: int,
    log: Path | None = None,
    stop: Callable[[str, dict[str, list[dict]]], bool] | None = None,
) -> dict[str, list[dict]]:
    """A worker per framework (``name -> command``), each started once the one before has replied
    to its first step (at once they would oversubscribe the cores),
    then ``rounds - 1`` more rounds of one step each, in an order that rotates every round; a worker
    whose reply says ``"last": true`` has finished and leaves the rotation, and one still going
    after the rounds goes on alone until it says so. ``stop(name, replies)`` true tells a worker to
    stop instead of go. Every reply, by framework."""
    replies: dict[str, list[dict]] = {name: [] for name in commands}
    workers: list[Worker] = []

    def go(w: Worker) -> None:
        w.go(STOP if stop is not None and stop(w.framework, replies) else "go")

    def take(w: Worker) -> None:
        reply = w.reply()
        replies[w.framework].append(reply)
        record(log, w.framework, len(replies[w.framework]), reply)
        w.done = bool(reply.get("last"))

    for name, command in commands.items():
        workers.append(Worker(name, command))
        take(workers[-1])
    for step in range(1, rounds):
        live = [w for w in workers if not w.done]
        if not live:
            break
        order = live[step % len(live) :] + live[: step % len(live)]
        for w in order:
            go(w)
            take(w)
    for w in workers:
        while not w.done:
            go(w)
            take(w)
        w.proc.wait()
    return replies


def record(log: Path | None, framework: str, step: int, reply: dict) -> None:
    """One finished step into ``log`` (JSONL), flushed at once: a stopped run keeps what it measured."""
    if log is not None:
        with log.open("a") as f:
            f.write(json.dumps({"framework": framework, "step": step, **reply}) + "\n")
