"""One rank of a multi-process train group: joins torch.distributed, loads the policy (and the
reference model) onto its device, and serves the Train Worker's methods to the driver."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from postrl.models.devices import resolve_device
from postrl.train.factory import PolicySpec, build_train_worker
from postrl.train.worker import PolicyTrainer
from postrl.workers.handles import WorkerHost


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


class TrainRank(WorkerHost):
    """Built in two phases so that a group can start all its ranks before any of them blocks:
    the constructor only records what to build; :meth:`join` (called on every rank at once by
    :class:`~postrl.train.group.TrainGroup`) enters the process group and builds the Train Worker,
    which then answers every call the rank does not define itself."""

    def __init__(self, rank: int, group: GroupSpec, policy: PolicySpec) -> None:
        self.rank = rank
        self.group = group
        self.policy = policy
        self._worker: PolicyTrainer | None = None

    @property
    def target(self) -> PolicyTrainer:
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

    def policy_state(self) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0 (every rank takes part in gathering them), None on the others:
        only rank 0's answer is used, so the others send nothing back."""
        state = self.target.policy_state()
        return state if self.rank == 0 else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
