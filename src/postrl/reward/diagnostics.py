"""Reward functions that misbehave on request, for soak tests and benchmarks of the service."""

from __future__ import annotations

import time


def misbehave(prompt: str, response: str, value: float = 0.0, kind: str = "ok", **columns: object) -> float:
    """``value`` back; with kind='sleep' it never returns, with kind='raise' it raises."""
    if kind == "sleep":
        time.sleep(3600)
    if kind == "raise":
        raise RuntimeError("asked to raise")
    return float(value)
