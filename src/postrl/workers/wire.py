"""Tensors across Ray as numpy arrays: Ray hands numpy arrays over through its shared-memory object
store without copying them, while a pickled torch tensor is copied into bytes on each side.

``pack`` replaces every tensor inside dicts, lists and tuples (a state dict, a list of rollouts'
fields) with a :class:`WireTensor`; ``unpack`` turns them back. Other objects pass as they are."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# numpy has no bfloat16: such tensors travel as their int16 bit patterns
_AS_BITS = {torch.bfloat16: torch.int16}


@dataclass
class WireTensor:
    array: np.ndarray
    dtype: str

    def tensor(self) -> torch.Tensor:
        """A tensor over the array's memory (read-only when Ray maps it from its store: the receivers
        copy weights into their own parameters, they never write into what arrived)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(self.array)
        wanted = getattr(torch, self.dtype)
        return t.view(wanted) if t.dtype != wanted else t


def pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        bits = _AS_BITS.get(t.dtype)
        array = (t.view(bits) if bits is not None else t).numpy()
        return WireTensor(array, str(t.dtype).removeprefix("torch."))
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and obj and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
        return type(obj)(pack(v) for v in obj)
    return obj


def unpack(obj: Any) -> Any:
    if isinstance(obj, WireTensor):
        return obj.tensor()
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and obj and any(isinstance(v, (WireTensor, dict, list, tuple)) for v in obj):
        return type(obj)(unpack(v) for v in obj)
    return obj
