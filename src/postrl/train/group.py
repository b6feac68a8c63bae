"""The driver's view of a multi-process train group: one handle whose calls fan out to every rank
(each call is a collective), answered by rank 0.

A rank that dies or stops answering stops the run with a message naming it; the other ranks are
then stopped too, since they would wait for it in their next collective."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from postrl.types import ExperienceBatch
from postrl.workers import Handle, WorkerDiedError, WorkerTimeoutError, gather
from postrl.workers.handles import submit


class TrainWorkerDiedError(RuntimeError):
    """A rank of the train group died or did not answer; the run cannot go on without it."""


class TrainGroup:
    """The ranks of a train group behind one :class:`~postrl.workers.handles.Handle`: a call goes to
    every rank at once (each is a collective) and rank 0 answers; a client made from the
    :class:`~postrl.workers.roles.TrainWorker` Protocol over it is the group's Train Worker."""

    concurrent = False
    in_process = False  # its ranks are called as a group: no callback reaches them

    def __init__(self, ranks: Sequence[Handle], call_timeout_s: float | None = None, name: str = "train group") -> None:
        if not ranks:
            raise ValueError("a train group needs at least one rank")
        self.ranks = list(ranks)
        self.name = name
        self.call_timeout_s = call_timeout_s
        self._all("join")  # every rank enters the process group at once (each waits for the others)

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``method`` on every rank (batches go as CPU tensors, paths as strings); rank 0's answer."""
        sent = tuple(
            a.to("cpu") if isinstance(a, ExperienceBatch) else str(a) if isinstance(a, Path) else a for a in args
        )
        return self._all(method, *sent, **kwargs)[0]

    def call_async(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Future:
        return submit(self.call, method, *args, timeout=timeout, **kwargs)

    def runs_beside(self, method: str) -> bool:
        return False  # every call is a collective of all ranks

    def attribute(self, name: str) -> Any:
        return self.ranks[0].attribute(name)

    def methods(self) -> frozenset[str]:
        return self.ranks[0].methods()

    def alive(self) -> bool:
        return all(h.alive() for h in self.ranks)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call every rank; on any failure stop them all (the others would wait for the failed one in
        their next collective) and raise, naming the rank."""
        futures = [h.call_async(method, *args, timeout=self.call_timeout_s, **kwargs) for h in self.ranks]
        try:
            return gather(futures, [h.name for h in self.ranks])
        except Exception as exc:
            dead = self._dead_ranks()
            self.kill()
            if dead or isinstance(exc, (WorkerDiedError, WorkerTimeoutError)):
                who = f"{', '.join(dead)} died" if dead else str(exc).splitlines()[0]
                raise TrainWorkerDiedError(
                    f"{who} during {method}. The train group cannot go on without it, so the run stops; resume "
                    "it from the last checkpoint with `postrl train --resume RUN_DIR`"
                ) from exc
            raise

    def _dead_ranks(self, grace_s: float = 2.0) -> list[str]:
        """Ranks whose process ended; a rank that crashed is given a moment to be reaped, since its
        peers may report the broken connection first."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [h.name for h in self.ranks if not h.alive()]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def close(self) -> None:
        """Every rank leaves the process group and ends, all at once (a rank may wait for its peers)."""
        gather([submit(h.close) for h in self.ranks], [h.name for h in self.ranks])

    def kill(self) -> None:
        for h in self.ranks:
            h.kill()
