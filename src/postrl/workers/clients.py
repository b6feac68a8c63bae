"""Typed clients of the roles over a handle: how the Controller calls a worker, wherever it lives.

Each client implements its role's Protocol (:mod:`postrl.workers.roles`) method by method through
:meth:`Handle.call`; with the local scheduler's :class:`~postrl.workers.handles.InProcessHandle`
that is a direct call of the object. Errors arrive typed (:mod:`postrl.workers.errors`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from postrl.types import ExperienceBatch, RewardResult, ScoreRequest, TrainMetrics
from postrl.workers.handles import Handle, WorkerDiedError, WorkerTimeoutError

log = logging.getLogger(__name__)


class Client:
    def __init__(self, handle: Handle, timeout: float | None = None) -> None:
        self.handle, self.timeout = handle, timeout

    def _call(self, method: str, *args: Any) -> Any:
        return self.handle.call(method, *args, timeout=self.timeout)

    def close(self) -> None:
        self.handle.close()


class TrainWorkerClient(Client):
    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        return self._call("update", batch)

    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        return self._call("reference_logprobs", batch)

    def set_kl_beta(self, beta: float) -> None:
        self._call("set_kl_beta", beta)

    def policy_state(self) -> dict[str, torch.Tensor]:
        return self._call("policy_state")

    def save_pretrained(self, folder: str | Path) -> None:
        self._call("save_pretrained", folder)

    def save_checkpoint(self, path: str | Path) -> None:
        self._call("save_checkpoint", path)

    def load_checkpoint(self, path: str | Path) -> None:
        self._call("load_checkpoint", path)


class CriticClient(Client):
    def values(self, batch: ExperienceBatch) -> torch.Tensor:
        return self._call("values", batch)

    def update(self, batch: ExperienceBatch) -> dict[str, float]:
        return self._call("update", batch)

    def save_checkpoint(self, path: str | Path) -> None:
        self._call("save_checkpoint", path)

    def load_checkpoint(self, path: str | Path) -> None:
        self._call("load_checkpoint", path)


class RewardServiceClient(Client):
    """The Reward Service behind a handle. With ``restart`` (a function that starts it again),
    a service that dies or stops answering is started again and the batch scored again (scoring
    has no side effects), up to ``max_restarts`` times in a run."""

    def __init__(
        self,
        handle: Handle,
        timeout: float | None = None,
        restart: Callable[[], Handle] | None = None,
        max_restarts: int = 8,
    ) -> None:
        super().__init__(handle, timeout)
        self.restart, self.max_restarts, self.restarts = restart, max_restarts, 0
        self.accuracy_component: str | None = handle.attribute("accuracy_component")
        self._log_file: Path | None = None

    def set_log_file(self, path: Path | None) -> None:
        self._log_file = path
        self._call("set_log_file", path)

    def error_count(self) -> int:
        """The service's own errors (lost scoring workers, retried requests) and its restarts here."""
        return self.restarts + int(self._call("error_count"))

    def score_batch(self, requests: list[ScoreRequest]) -> list[RewardResult]:
        while True:
            try:
                return self._call("score_batch", requests)
            except (WorkerDiedError, WorkerTimeoutError) as exc:
                self.restarts += 1
                if self.restart is None or self.restarts > self.max_restarts:
                    raise
                log.warning("the reward service was lost (%s); starting it again and rescoring", exc)
                self.handle.kill()
                self.handle = self.restart()
                if self._log_file is not None:
                    self._call("set_log_file", self._log_file)
