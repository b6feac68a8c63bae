"""Reward functions that misbehave on request, for soak tests and benchmarks of the service."""

from __future__ import annotations

import os
import time
from pathlib import Path


def misbehave(prompt: str, response: str, value: float = 0.0, kind: str = "ok", **columns: object) -> float:
    """``value`` back; with kind='sleep' it never returns, with kind='raise' it raises."""
    if kind == "sleep":
        time.sleep(3600)
    if kind == "raise":
        raise RuntimeError("asked to raise")
    return float(value)


def process_descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc): what a service has left running."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
