"""A train rank that also hands its gradients back (tests only): used to compare an FSDP2 group
with one process."""

from __future__ import annotations

import torch

from postrl.train.rank import TrainRank
from postrl.train.state import full_tensor
from postrl.types import ExperienceBatch


class GradProbe(TrainRank):
    def gradients(self, batch: ExperienceBatch) -> tuple[float, float, dict[str, torch.Tensor]]:
        """(summed loss, tokens, full gradients) of one mini-batch, without an optimizer step."""
        worker = self.target
        worker.model.train()
        stats = worker.accumulate_gradients(batch)
        grads = {name: full_tensor(p.grad).detach().clone() for name, p in worker.model.named_parameters()}
        worker.optimization.optimizer.zero_grad(set_to_none=True)
        return float(stats.value("actor/loss")), float(stats.value("tokens")), grads
