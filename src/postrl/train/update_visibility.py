"""How much of an update a bf16 copy of the weights carries.

A bf16 rollout engine samples with a rounding of the trainer's float32 master weights. An entry
whose change in one update is under half a bf16 step (about 2^-9 of its magnitude) does not move
its bf16 value: at a small learning rate most of an update can stay in the master weights, and the
engine samples from the policy of several steps ago until the changes add up to a rounding step.
:class:`Bf16Visibility` measures, for one update, the share of the master weights' change (summed
|change|) that lies on entries whose bf16 value moved: 1.0 when the whole update reaches a bf16
copy, 0.0 when none of it does (``train/update_visible_bf16``). It samples at most
``MAX_SAMPLES`` entries at a fixed stride over every trained float32 parameter into one vector, so
the measurement costs a strided copy and a few passes over it (about 1 ms a step on 2 CPU cores),
not a second copy of the model.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

MAX_SAMPLES = 1 << 18  # a share estimated from 262,144 entries is within about 0.2% of the whole


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's entries: a sharded (FSDP2) parameter's own shard, which is what a rank samples."""
    return p.to_local() if isinstance(p, DTensor) else p


class Bf16Visibility:
    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad and p.dtype == torch.float32]
        total = sum(_local(p).numel() for p in self.params)
        self.stride = max(1, total // MAX_SAMPLES)
        self.before: torch.Tensor | None = None

    @property
    def applies(self) -> bool:
        """Only float32 master weights have a bf16 rounding to measure against."""
        return bool(self.params)

    def _sample(self) -> torch.Tensor:
        return torch.cat([_local(p).detach().reshape(-1)[:: self.stride] for p in self.params])

    def start(self) -> None:
        """Before the update: remember the sampled entries."""
        self.before = self._sample() if self.applies else None

    @torch.no_grad()
    def share(self) -> float | None:
        """After the update: the visible share of its change; None when nothing changed (or no float32 weights)."""
        if self.before is None:
            return None
        old, new, self.before = self.before, self._sample(), None
        change = (new - old).abs()
        visible = old.to(torch.bfloat16) != new.to(torch.bfloat16)
        total = float(change.sum(dtype=torch.float64))
        moved = float(torch.where(visible, change, 0.0).sum(dtype=torch.float64))
        return moved / total if total > 0 else None
