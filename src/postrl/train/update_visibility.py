"""How much of an update a bf16 copy of the weights carries.

A bf16 rollout engine samples with a rounding of the trainer's float32 master weights. An entry
whose change in one update is under half a bf16 step (about 2^-9 of its magnitude) does not move
its bf16 value: at a small learning rate most of an update can stay in the master weights, and the
engine samples from the policy of several steps ago until the changes add up to a rounding step.
:class:`Bf16Visibility` measures, for one update, the share of the master weights' change (summed
|change|) that lies on entries whose bf16 value moved: 1.0 when the whole update reaches a bf16
copy, 0.0 when none of it does (``train/update_visible_bf16``). It samples at most
``MAX_SAMPLES`` entries at a fixed stride over every trained float32 parameter, so the measurement
costs a strided copy, not a second copy of the model.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

MAX_SAMPLES = 1 << 20


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's entries: a sharded (FSDP2) parameter's own shard, which is what a rank samples."""
    return p.to_local() if isinstance(p, DTensor) else p


class Bf16Visibility:
    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad and p.dtype == torch.float32]
        total = sum(_local(p).numel() for p in self.params)
        self.stride = max(1, total // MAX_SAMPLES)
        self.before: list[torch.Tensor] = []

    @property
    def applies(self) -> bool:
        """Only float32 master weights have a bf16 rounding to measure against."""
        return bool(self.params)

    def _sample(self) -> list[torch.Tensor]:
        return [_local(p).detach().reshape(-1)[:: self.stride].clone() for p in self.params]

    def start(self) -> None:
        """Before the update: remember the sampled entries."""
        self.before = self._sample() if self.applies else []

    @torch.no_grad()
    def share(self) -> float | None:
        """After the update: the visible share of its change; None when nothing changed (or no float32 weights)."""
        if not self.before:
            return None
        moved = total = 0.0
        for old, new in zip(self.before, self._sample()):
            change = (new - old).abs().double()
            visible = old.to(torch.bfloat16) != new.to(torch.bfloat16)
            moved += float(change[visible].sum())
            total += float(change.sum())
        self.before = []
        return moved / total if total > 0 else None
