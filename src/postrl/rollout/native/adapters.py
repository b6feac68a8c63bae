"""LoRA adapters applied unmerged in the native engine: ``y = x W^T + s (x A^T) B^T``.

A sync from a LoRA trainer (:mod:`postrl.train.lora`) sends ``NAME.lora_A`` (``[r, in]``),
``NAME.lora_B`` (``[out, r]``) and ``NAME.lora_scale`` for each adapted layer, NAME being its
Hugging Face name. The engine's projections are fused (q|k|v, gate|up), so each adapter adds into
its columns of the fused output. The base weights are never touched: what the engine computes is
what the trainer computes, not a merge rounded to the engine's dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_NAME = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
)


@dataclass
class Adapter:
    columns: slice  # of the fused projection's output
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class FusedAdapters:
    """A fused projection's adapters as two matmuls: ``(x A^T) B^T`` with A the adapters' A stacked
    (``[sum r, in]``) and B block-placed into the projection's columns, scales folded in
    (``[width, sum r]``): 3 operations per projection instead of 3 per adapter."""

    a_t: torch.Tensor  # [in, sum r]: the stacked A, transposed once (contiguous for the matmul)
    b_t: torch.Tensor  # [sum r, width]

    @staticmethod
    def of(adapters: list[Adapter], width: int) -> FusedAdapters:
        a = torch.cat([ad.a for ad in adapters])
        b = torch.zeros(width, a.shape[0], dtype=a.dtype, device=a.device)
        start = 0
        for ad in adapters:
            rank = ad.a.shape[0]
            b[ad.columns, start : start + rank] = ad.b * ad.scale
            start += rank
        return FusedAdapters(a.t().contiguous(), b.t().contiguous())


class EngineAdapters:
    """Adapters by (layer, fused projection): ``qkv``, ``o``, ``gate_up``, ``down``."""

    def __init__(self, layers: int, hidden: int, q_out: int, kv_out: int, intermediate: int) -> None:
        self.layers = layers
        self.place = {  # projection -> (fused group, columns, input width)
            "q_proj": ("qkv", slice(0, q_out), hidden),
            "k_proj": ("qkv", slice(q_out, q_out + kv_out), hidden),
            "v_proj": ("qkv", slice(q_out + kv_out, q_out + 2 * kv_out), hidden),
            "o_proj": ("o", slice(0, hidden), q_out),
            "gate_proj": ("gate_up", slice(0, intermediate), hidden),
            "up_proj": ("gate_up", slice(intermediate, 2 * intermediate), hidden),
            "down_proj": ("down", slice(0, hidden), intermediate),
        }
        self.widths = {"qkv": q_out + 2 * kv_out, "o": hidden, "gate_up": 2 * intermediate, "down": hidden}
        self.by_group: dict[tuple[int, str], FusedAdapters] = {}

    def __bool__(self) -> bool:
        return bool(self.by_group)

    def load(self, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> list[str]:
        """Replace every adapter with those in ``state`` (all of a layer's three tensors, checked
        against the model's shapes before anything changes); returns the names read."""
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            module, part = key.rsplit(".", 1)
            modules.setdefault(module, {})[part] = tensor
        staged: dict[tuple[int, str], list[Adapter]] = {}
        for module, parts in modules.items():
            match = _NAME.match(module)
            if match is None:
                raise RuntimeError(f"adapter {module!r} is not a projection of a decoder layer the engine has")
            if set(parts) != {"lora_A", "lora_B", "lora_scale"}:
                raise RuntimeError(f"adapter {module!r} needs lora_A, lora_B and lora_scale, got {sorted(parts)}")
            layer, proj = int(match.group(1)), match.group(3)
            group, columns, width = self.place[proj]
            a, b = parts["lora_A"], parts["lora_B"]
            out = columns.stop - columns.start
            if layer >= self.layers or a.dim() != 2 or a.shape[1] != width or tuple(b.shape) != (out, a.shape[0]):
                raise RuntimeError(
                    f"adapter {module!r}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a [{out}, {width}] projection"
                )
            adapter = Adapter(columns, a.to(device, dtype), b.to(device, dtype), float(parts["lora_scale"]))
            staged.setdefault((layer, group), []).append(adapter)
        self.by_group = {key: FusedAdapters.of(group, self.widths[key[1]]) for key, group in staged.items()}
        return list(state)

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the fused projection of ``x``) with this layer's adapters added into their columns."""
        fused = self.by_group.get((layer, group))
        if fused is None:
            return out
        return out.addmm_(x @ fused.a_t, fused.b_t)
