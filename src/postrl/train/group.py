"""The driver's view of a multi-process train group: the Train Worker interface, fanned out to
every rank (each call is a collective), answered by rank 0.

A rank that dies or stops answering stops the run with a message naming it; the other ranks are
then stopped too, since they would wait for it in their next collective."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from postrl.types import ExperienceBatch, TrainMetrics
from postrl.workers import Handle, WorkerDiedError, WorkerTimeoutError, gather
from postrl.workers.handles import submit


class TrainWorkerDiedError(RuntimeError):
    """A rank of the train group died or did not answer; the run cannot go on without it."""


class TrainGroup:
    def __init__(self, ranks: Sequence[Handle], call_timeout_s: float | None = None) -> None:
        if not ranks:
            raise ValueError("a train group needs at least one rank")
        self.ranks = list(ranks)
        self.call_timeout_s = call_timeout_s
        self._all("join")  # every rank enters the process group at once (each waits for the others)

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call every rank; on any failure stop them all (the others would wait for the failed one in
        their next collective) and raise, naming the rank."""
        futures = [h.call_async(method, *args, timeout=self.call_timeout_s) for h in self.ranks]
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

    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        return self._all("update", batch.to("cpu"))[0]

    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        return self._all("reference_logprobs", batch.to("cpu"))[0]

    def set_kl_beta(self, beta: float) -> None:
        self._all("set_kl_beta", beta)

    def policy_state(self) -> dict[str, torch.Tensor]:
        return self._all("policy_state")[0]

    def save_checkpoint(self, path: str | Path) -> None:
        self._all("save_checkpoint", str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        self._all("load_checkpoint", str(path))

    def save_pretrained(self, folder: str | Path) -> None:
        self._all("save_pretrained", str(folder))

    def close(self) -> None:
        """Every rank leaves the process group and ends, all at once (a rank may wait for its peers)."""
        gather([submit(h.close) for h in self.ranks], [h.name for h in self.ranks])

    def kill(self) -> None:
        for h in self.ranks:
            h.kill()
