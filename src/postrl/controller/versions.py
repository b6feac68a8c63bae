"""The run's counters that several threads read: completed steps, the trainer's weight version and
the newest version the engines hold, with the condition that wakes whoever waits for them to move
(an async run's producer waits for versions, the consumer bumps them, the weight sync reports them)."""

from __future__ import annotations

import threading

from postrl.config.off_policy import BufferConfig


class Versions:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.step = 0  # completed steps
        self.weight = 0  # the trainer's weights
        self.engine = 0  # the newest version the engines hold (async: behind the trainer's)

    def bump(self) -> int:
        """A new weight version (the update is done); returns it."""
        with self.cv:
            self.weight += 1
            self.cv.notify_all()
            return self.weight

    def engines_hold(self, version: int) -> None:
        with self.cv:
            self.engine = version
            self.cv.notify_all()

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def may_start(self, batch: int, buffer: BufferConfig) -> bool:
        """Batch ``batch`` (from 1) trains under version ``batch - 1``: it may start once its lag
        can stay within ``buffer.max_staleness`` (with ``on_stale: wait``, once the engines hold that
        version). Called with :attr:`cv` held."""
        held = self.engine if buffer.on_stale == "wait" else self.weight
        return held >= batch - 1 - buffer.max_staleness
