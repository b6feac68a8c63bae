"""A Train Worker method added the way a contributor adds one: to the role's Protocol (here a
Protocol extending :class:`TrainWorker`; in the source, one method in ``workers/roles.py``) and to
its implementation (here set on :class:`PolicyTrainer` when this module is imported; in the
source, one method in ``train/worker.py``). Nothing else is touched: the client, the hosts, the
train group and the schedulers reach it as they are."""

from __future__ import annotations

from typing import Protocol

import torch

from postrl.train.rank import TrainRank
from postrl.train.worker import PolicyTrainer
from postrl.types import ExperienceBatch
from postrl.workers.roles import TrainWorker


class EvaluatingTrainWorker(TrainWorker, Protocol):
    def evaluate(self, batch: ExperienceBatch) -> float:
        """The policy's mean logprob of the batch's trained tokens."""
        ...


def evaluate(self: PolicyTrainer, batch: ExperienceBatch) -> float:
    batch = batch.to(next(self.model.parameters()).device)
    with torch.no_grad():
        logp, _ = self._policy_logprobs(batch, "off")
    return float((logp * batch.loss_mask).sum() / batch.loss_mask.sum())


PolicyTrainer.evaluate = evaluate  # type: ignore[attr-defined]


class ProbeRank(TrainRank):
    """A train rank whose process imports this module (and with it the new method)."""
