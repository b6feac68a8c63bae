"""The console's view of a step's long phases (:mod:`postrl.types.progress`): done / total, tokens/s
and the time left, on the step's progress bar where the output is a terminal, else as plain lines
few enough for a log file."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from postrl.run.metrics import duration
from postrl.types.progress import Phase, install

AFTER_S = 5.0  # a phase shorter than this shows nothing
EVERY_S = 30.0  # between two plain lines of one phase (not a terminal)
TICK_S = 0.5  # how often what is due is shown (a terminal's line is redrawn)
BAR_WIDTH = 10  # characters of a phase's bar on a terminal


def describe(phase: Phase, now: float, bar: bool = False) -> str:
    """``generate: 120/256 samples (47%), 1234 tok/s, 34s elapsed, ~38s left``; with ``bar``, a bar of
    the share done after the name (``generate [####......] 120/256 samples ...``)."""
    done, tokens = phase.snapshot()
    elapsed = max(now - phase.started, 1e-9)
    share = min(done / phase.total, 1.0) if phase.total else 0.0
    filled = round(share * BAR_WIDTH)
    head = f"{phase.name} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}]" if bar else f"{phase.name}:"
    parts = [f"{head} {done}/{phase.total} {phase.unit}" + (f" ({share:.0%})" if phase.total else "")]
    if tokens:
        parts.append(f"{tokens / elapsed:.0f} tok/s")
    left = f", ~{duration(elapsed / done * (phase.total - done))} left" if 0 < done < phase.total else ""
    parts.append(f"{duration(elapsed)} elapsed{left}")
    return ", ".join(parts)


def finished(phase: Phase, now: float) -> str:
    """``generate: 256/256 samples in 1m40s, 1234 tok/s``."""
    done, tokens = phase.snapshot()
    elapsed = max(now - phase.started, 1e-9)
    rate = f", {tokens / elapsed:.0f} tok/s" if tokens else ""
    return f"{phase.name}: {done}/{phase.total} {phase.unit} in {duration(elapsed)}{rate}"


class ConsoleProgress:
    """A :class:`~postrl.types.progress.Reporter` for the console. A phase shows once it has run
    ``after_s``; a phase that ends sooner shows nothing. On a terminal (``lines=False``) ``show``
    gets the open phases' text every ``tick_s`` (the step bar's postfix) and an empty text when none
    is left; otherwise (``lines=True``) ``show`` gets a line per phase every ``every_s`` and one when a
    phase that was shown ends, so that a log holds a few lines per long phase."""

    def __init__(
        self,
        show: Callable[[str], None],
        lines: bool,
        after_s: float | None = None,
        every_s: float | None = None,
        tick_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        ticking: bool = True,
    ) -> None:
        """``after_s``, ``every_s``, ``tick_s``: :data:`AFTER_S`, :data:`EVERY_S`, :data:`TICK_S` where not given; ``ticking=False``:
        no thread of its own (the caller calls :meth:`tick`)."""
        self.show = show
        self.lines = lines
        self.after_s = AFTER_S if after_s is None else after_s
        self.every_s = EVERY_S if every_s is None else every_s
        self.tick_s = TICK_S if tick_s is None else tick_s
        self.clock = clock
        self._open: list[Phase] = []
        self._shown: dict[int, float] = {}  # id of a phase shown -> when it last was
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if ticking:
            self._thread = threading.Thread(target=self._run, name="postrl-progress", daemon=True)
            self._thread.start()

    def opened(self, phase: Phase) -> None:
        phase.started = self.clock()
        with self._lock:
            self._open.append(phase)

    def closed(self, phase: Phase) -> None:
        with self._lock:
            self._open = [p for p in self._open if p is not phase]
            shown = self._shown.pop(id(phase), None) is not None
            still_open = bool(self._open)
        if shown and self.lines:
            self.show(finished(phase, self.clock()))
        elif shown and not still_open:
            self.show("")

    def tick(self) -> None:
        """Show what is due now."""
        now = self.clock()
        with self._lock:
            due = [p for p in self._open if now - p.started >= self.after_s]
            if self.lines:
                due = [p for p in due if now - self._shown.get(id(p), -float("inf")) >= self.every_s]
            for p in due:
                self._shown[id(p)] = now
        if not due:
            return
        if self.lines:
            for p in due:
                self.show(describe(p, now))
        else:
            self.show(" · ".join(describe(p, now, bar=True) for p in due))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()


def overwritten_line(stream: TextIO) -> Callable[[str], None]:
    """``show`` for a terminal without a step bar: the text in place on one line (empty: erased)."""

    def show(text: str) -> None:
        stream.write("\r\033[K" + text)
        stream.flush()

    return show


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextmanager
def shown_on_console(enabled: bool = True, bar: Callable[[str], None] | None = None) -> Iterator[None]:
    """Long phases shown on the console while the block runs: through ``bar`` (a terminal's progress
    bar) where given, else on one line of stderr where it is a terminal, as plain lines where it is not."""
    if not enabled:
        yield
        return
    in_place = bar or (overwritten_line(sys.stderr) if sys.stderr.isatty() else None)
    progress = ConsoleProgress(in_place or _stderr_line, lines=in_place is None)
    before = install(progress)
    try:
        yield
    finally:
        install(before)
        progress.close()
