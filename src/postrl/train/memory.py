"""Peak memory of a phase: allocated device memory on a GPU, resident memory on the CPU.

On the CPU the figure is the process's resident-set high-water mark (``VmHWM``), reset when the
phase starts (``/proc/self/clear_refs``), so it counts everything the process holds during the
phase (weights, optimizer state, activations, and anything else the process keeps, such as an
in-process rollout engine). On CUDA it is ``torch.cuda.max_memory_allocated`` of the device,
reset when the phase starts: tensors only, not the caching allocator's reserve.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def resident_high_water_mb() -> float:
    """The process's peak resident memory since it started or since the last reset (Linux), MB."""
    if STATUS.exists():
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB; no reset there


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.mb``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mb = float("nan")

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident size
            except OSError:
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self.mb = resident_high_water_mb()
