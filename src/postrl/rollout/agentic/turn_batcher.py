"""Turns from episodes scheduled one by one, merged for an engine that runs its calls one after
another (``RolloutWorker.joins_calls`` False: the HF engine, vLLM's offline engine, engines behind a
child process's single pipe).

Each episode's thread asks for its turn; the turns that arrive while a batch is being generated wait
and go together in the next one (one ``generate`` per sampling, e.g. per token budget). There is no
thread of its own: the caller whose turn is oldest runs the batch, and a caller answered by a batch
hands the next one to another waiting caller, so torch work stays on the callers' threads. An
engine that joins calls needs none of this: each episode calls it directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from postrl.types import Prompt, Rollout, SamplingParams

Generate = Callable[[list[Prompt], SamplingParams], list[Rollout]]


@dataclass(eq=False)
class _Turn:
    prompt: Prompt
    sampling: SamplingParams
    answer: Future[Rollout] = field(default_factory=Future)


class TurnBatcher:
    """``generate`` for one episode's turn at a time, batched across the episodes waiting."""

    def __init__(self, generate: Generate, max_batch: int = 256) -> None:
        self.generate = generate
        self.max_batch = max_batch
        self._queue: list[_Turn] = []
        self._running = False
        self._changed = threading.Condition()
        self.batches = 0  # generate calls made

    def __call__(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """The ``sampling.n`` rollouts of each prompt; n must be 1 (a turn continues one sample)."""
        if sampling.n != 1:
            raise ValueError(f"a turn continues one sample: n must be 1, not {sampling.n}")
        turns = [_Turn(p, sampling) for p in prompts]
        with self._changed:
            self._queue += turns
            self._changed.notify_all()
        while not all(t.answer.done() for t in turns):
            with self._changed:
                self._changed.wait_for(lambda: all(t.answer.done() for t in turns) or not self._running)
                if all(t.answer.done() for t in turns):
                    break
                self._running = True
            try:
                self._run_batch()
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()
        return [t.answer.result() for t in turns]

    def _run_batch(self) -> None:
        """Generate every queued turn (up to ``max_batch``), one call per sampling."""
        with self._changed:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        by_sampling: dict[SamplingParams, list[_Turn]] = {}
        for t in batch:
            by_sampling.setdefault(t.sampling, []).append(t)
        try:
            for sampling, group in by_sampling.items():
                self.batches += 1
                try:
                    rollouts = self.generate([t.prompt for t in group], sampling)
                except Exception as exc:  # noqa: BLE001 - every turn of the batch gets the error
                    for t in group:
                        t.answer.set_exception(exc)
                    continue
                for t, r in zip(group, rollouts, strict=True):
                    t.answer.set_result(r)
        except BaseException as exc:  # interrupted: no caller waits forever for a turn taken here
            for t in batch:
                if not t.answer.done():
                    t.answer.set_exception(RuntimeError(f"the batch of this turn was interrupted: {exc!r}"))
            raise
