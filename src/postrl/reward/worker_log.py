"""What the scoring workers write to stderr (reward functions' prints), collected into one log: a
file or stream once the run names one, kept in memory (up to 1 MB) until then."""

from __future__ import annotations

import os
import threading
from typing import IO, Any

EARLY_LIMIT = 1 << 20  # bytes kept before a log file is set


class WorkerLog:
    def __init__(self) -> None:
        self._file: Any = None
        self._borrowed: Any = None  # a stream the caller owns (not closed here)
        self._early = bytearray()
        self._lock = threading.Lock()

    def set_file(self, path: str | os.PathLike | Any) -> None:
        """Append to ``path``, or to an open binary stream (a server passes its own stderr); what
        was written before goes there first."""
        borrowed = not isinstance(path, (str, os.PathLike))
        fh: Any = path if borrowed else open(path, "ab")
        with self._lock:
            old, self._file = self._file, fh
            if self._early:
                fh.write(bytes(self._early))
                fh.flush()
                self._early.clear()
            if old is not None and old is not self._borrowed:
                old.close()
            self._borrowed = fh if borrowed else None

    def read(self, stream: IO[bytes]) -> None:
        """What a worker's stderr holds now (non-blocking)."""
        try:
            chunk = os.read(stream.fileno(), 1 << 16)
        except (BlockingIOError, ValueError, OSError):
            return
        if chunk:
            self.write(chunk)

    def drain(self, stream: IO[bytes]) -> None:
        """Everything left on a worker's stderr (it is being removed)."""
        while True:
            try:
                chunk = os.read(stream.fileno(), 1 << 16)
            except (BlockingIOError, ValueError, OSError):
                return
            if not chunk:
                return
            self.write(chunk)

    def write(self, chunk: bytes) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(chunk)
                self._file.flush()
            elif len(self._early) < EARLY_LIMIT:
                self._early += chunk[: EARLY_LIMIT - len(self._early)]

    def close(self) -> None:
        with self._lock:
            if self._file is not None and self._file is not self._borrowed:
                self._file.close()
            self._file = None
