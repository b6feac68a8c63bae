"""Where tensors live: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` from the config, checked before any work."""

from __future__ import annotations

import re

import torch

from postrl.config.base import DEVICE_PATTERN


class DeviceError(ValueError):
    """A configured device this machine does not have."""


def resolve_device(name: str, field: str = "device") -> torch.device:
    """``auto`` is the first CUDA device when one is present, else the CPU; a CUDA device that is not
    there is an error naming the config field (never a silent fall back to the CPU)."""
    if not re.match(DEVICE_PATTERN, name):
        raise DeviceError(f"{field}={name!r}: use auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"{field}={name}, but this machine has no usable CUDA device "
                f"(torch {torch.__version__} sees none); use {field}=cpu or auto"
            )
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise DeviceError(f"{field}={name}, but only {torch.cuda.device_count()} CUDA devices are visible")
        device = torch.device("cuda", index)
    return device


def bf16_matmul_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def bf16_is_fast(device: torch.device) -> bool:
    """bf16 matrix products are native on CUDA (compute capability >= 8) and on CPUs with AMX or AVX512-BF16."""
    if device.type == "cuda":
        return bf16_matmul_supported(device)
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
