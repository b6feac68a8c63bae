"""GPU presets: memory, dense bf16 tensor rate and memory bandwidth, from the vendors' data sheets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gb: float  # 1e9 bytes, as the data sheets count
    bf16_tflops: float  # dense (no sparsity)
    bandwidth_gbs: float

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


GPUS: dict[str, GpuSpec] = {
    spec.name.lower(): spec
    for spec in (
        GpuSpec("H100", 80.0, 989.0, 3350.0),  # SXM
        GpuSpec("H200", 141.0, 989.0, 4800.0),
        GpuSpec("A100", 80.0, 312.0, 2039.0),  # SXM 80 GB
        GpuSpec("H20", 96.0, 148.0, 4000.0),
        GpuSpec("L40S", 48.0, 362.0, 864.0),
        GpuSpec("RTX4090", 24.0, 165.0, 1008.0),  # bf16 with fp32 accumulate
    )
}


def gpu_spec(name: str | None, memory_gb: float | None = None) -> GpuSpec:
    """A preset by name (case and punctuation ignored: ``h100``, ``RTX 4090``), or a GPU of
    ``memory_gb`` with an H100's rates; neither: an H100."""
    if name is None:
        base = GPUS["h100"]
        if memory_gb is None:
            return base
        return GpuSpec(f"{memory_gb:g} GB GPU", memory_gb, base.bf16_tflops, base.bandwidth_gbs)
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    if key not in GPUS:
        raise ValueError(
            f"unknown GPU '{name}': choose one of {', '.join(s.name for s in GPUS.values())} or --gpu-memory GB"
        )
    spec = GPUS[key]
    if memory_gb is not None:
        return GpuSpec(spec.name, memory_gb, spec.bf16_tflops, spec.bandwidth_gbs)
    return spec
