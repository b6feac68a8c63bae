"""Training statistics by name, each with its reduction, reduced once.

A policy loss reports per-token metrics (:class:`postrl.algorithms.TokenMetric`); the trainer adds
its own (the loss, the KL, the entropy, the rollout/trainer mismatch). Over micro-batches they
accumulate on the device as 0-d tensors (no device-to-host copy per micro-batch), are read back once
per optimizer step together with the gradient norm, and are summed across optimizer steps on the
host. ``token_mean`` metrics are divided by the trained-token count at the end, so a token's weight
does not depend on the micro- or mini-batch it fell in.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Reduction = Literal["token_mean", "sum", "max"]
TOKENS = "tokens"  # the trained-token count every token_mean is divided by


class Stats:
    """``name -> (reduction, value)``; values are 0-d tensors (device) or floats (host)."""

    def __init__(self, values: dict[str, tuple[Reduction, torch.Tensor | float]] | None = None) -> None:
        self.values: dict[str, tuple[Reduction, torch.Tensor | float]] = dict(values or {})

    def add(self, name: str, reduction: Reduction, value: torch.Tensor | float) -> None:
        """Fold in a value already reduced over its tokens (summed, or the maximum)."""
        if name not in self.values:
            self.values[name] = (reduction, value)
            return
        kind, current = self.values[name]
        if kind != reduction:
            raise ValueError(f"metric {name} is reported as {reduction} here and as {kind} before")
        self.values[name] = (kind, _combine(kind, current, value))

    def value(self, name: str) -> torch.Tensor | float:
        return self.values[name][1]

    def merge(self, other: Stats) -> Stats:
        out = Stats(self.values)
        for name, (kind, value) in other.values.items():
            out.add(name, kind, value)
        return out

    def read(self, *extra: torch.Tensor) -> tuple[Stats, list[float]]:
        """Every value (and ``extra`` 0-d tensors) copied to the host in one transfer."""
        names = sorted(self.values)
        tensors = [torch.as_tensor(t).float().reshape(()) for t in extra]
        device = tensors[0].device if tensors else None
        stacked = [torch.as_tensor(self.values[n][1], device=device).float().reshape(()) for n in names]
        numbers = torch.stack(tensors + stacked).tolist() if tensors or stacked else []
        host = Stats({n: (self.values[n][0], v) for n, v in zip(names, numbers[len(tensors) :])})
        return host, numbers[: len(tensors)]

    def all_reduce(self) -> Stats:
        """Summed (maxima: the largest) over the ranks of the default process group; every rank must
        report the same names."""
        import torch.distributed as dist

        out = Stats()
        for op, kinds in ((dist.ReduceOp.SUM, ("token_mean", "sum")), (dist.ReduceOp.MAX, ("max",))):
            names = sorted(n for n, (k, _) in self.values.items() if k in kinds)
            if not names:
                continue
            stacked = torch.stack([torch.as_tensor(self.values[n][1]).float() for n in names])
            dist.all_reduce(stacked, op=op)
            for name, value in zip(names, stacked.unbind()):
                out.values[name] = (self.values[name][0], value)
        return out

    def finish(self, empty: float = math.nan) -> dict[str, float]:
        """The metrics: token means over the trained tokens, sums, maxima; every one is ``empty``
        when no token was trained."""
        tokens = float(self.values[TOKENS][1]) if TOKENS in self.values else 0.0
        out = {}
        for name, (kind, value) in self.values.items():
            if name != TOKENS:
                out[name] = empty if not tokens else float(value) / tokens if kind == "token_mean" else float(value)
        return out


def _combine(kind: Reduction, a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor | float:
    if kind == "max":
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
        return max(a, b)
    return a + b
