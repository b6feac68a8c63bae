"""One rank of a multi-process train group: joins torch.distributed, loads the policy (and the
reference model) onto its device, and serves the Train Worker's methods to the driver."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from postrl.models.devices import resolve_device
from postrl.train.factory import PolicySpec, build_train_worker
from postrl.train.worker import TrainWorker
from postrl.types import ExperienceBatch, TrainMetrics


@dataclass(frozen=True)
class GroupSpec:
    """Where the ranks meet: the rendezvous address, the size, and the collective timeout."""

    world: int
    master_addr: str
    master_port: int
    timeout_s: float = 600.0


def rank_device(name: str, rank: int) -> torch.device:
    """``auto``/``cuda`` give each rank its own GPU (the local rank modulo the GPUs it can see)."""
    device = resolve_device(name, "train.device")
    if device.type == "cuda" and name in ("auto", "cuda"):
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


class TrainRank:
    """Built in two phases so that a group can start all its ranks before any of them blocks:
    the constructor only records what to build; :meth:`join` (called on every rank at once by
    :class:`~postrl.train.group.TrainGroup`) enters the process group and loads the model."""

    def __init__(self, rank: int, group: GroupSpec, policy: PolicySpec) -> None:
        self.rank, self.group, self.policy = rank, group, policy
        self._worker: TrainWorker | None = None

    @property
    def worker(self) -> TrainWorker:
        if self._worker is None:
            raise RuntimeError(f"train rank {self.rank} has not joined its group yet (call join first)")
        return self._worker

    def join(self) -> int:
        """Enter the process group (waits for every rank) and build the Train Worker; returns the rank."""
        from postrl.models.loading import quiet_transformers

        if self._worker is not None:
            return self.rank
        quiet_transformers()
        rank, group, policy = self.rank, self.group, self.policy
        device = rank_device(policy.train.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if group.world > 1:
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                rank=rank,
                world_size=group.world,
                init_method=f"tcp://{group.master_addr}:{group.master_port}",
                timeout=timedelta(seconds=group.timeout_s),
            )
        torch.manual_seed(policy.seed)
        self._worker = build_train_worker(policy, device, group.world)
        return self.rank

    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        return self.worker.update(batch)

    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """Every rank runs the whole batch (the forward is a collective); rank 0's answer is used."""
        return self.worker.reference_logprobs(batch)

    def set_kl_beta(self, beta: float) -> None:
        self.worker.set_kl_beta(beta)

    def policy_state(self) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0 (tied tensors once), None on the others."""
        state = self.worker.policy_state()
        return state if self.rank == 0 else None

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> None:
        self.worker.load_checkpoint(Path(path))

    def save_pretrained(self, folder: str) -> None:
        self.worker.save_pretrained(Path(folder))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
