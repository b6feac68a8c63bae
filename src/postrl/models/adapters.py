"""LoRA adapters as a weight sync carries them, and as a peft adapter folder for engines that load
adapters from disk (vLLM).

A sync from a LoRA trainer (:mod:`postrl.train.lora`) holds, for every adapted linear layer,
``NAME.lora_A`` (``[r, in]``), ``NAME.lora_B`` (``[out, r]``) and ``NAME.lora_scale`` (one
element), NAME being the layer's Hugging Face name (``model.layers.0.self_attn.q_proj``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ADAPTER_SUFFIXES = (".lora_A", ".lora_B", ".lora_scale")


def is_adapter_key(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def is_adapter_state(names: list[str] | dict[str, torch.Tensor]) -> bool:
    """Whether a sync holds adapters only (a LoRA sync), not whole weights."""
    names = list(names)
    return bool(names) and all(is_adapter_key(n) for n in names)


def adapter_modules(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Layer name -> (A, B, scale), every layer with all three tensors and fitting shapes."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if not is_adapter_key(key):
            raise ValueError(f"{key} is not an adapter tensor (names end in {', '.join(ADAPTER_SUFFIXES)})")
        name, kind = key.rsplit(".", 1)
        parts.setdefault(name, {})[kind] = tensor
    modules = {}
    for name, got in parts.items():
        if set(got) != {"lora_A", "lora_B", "lora_scale"}:
            raise ValueError(f"adapter {name} needs lora_A, lora_B and lora_scale; the sync has {sorted(got)}")
        a, b = got["lora_A"], got["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"adapter {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit")
        modules[name] = (a, b, float(got["lora_scale"].reshape(-1)[0]))
    return modules


def write_peft_adapter(state: dict[str, torch.Tensor], folder: Path, base_model: str = "") -> Path:
    """``state`` (a LoRA sync) as a peft adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``, the layout peft and vLLM load). Every layer's rank and scale
    go into the config (``rank_pattern``/``alpha_pattern`` where they differ from the first's),
    so a loader computes exactly ``x W + s (x A) B``."""
    modules = adapter_modules(state)
    if not modules:
        raise ValueError("an adapter sync with no adapters")
    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b, _) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().cpu().contiguous()
    first_a, _, first_scale = next(iter(modules.values()))
    rank = first_a.shape[0]
    rank_pattern = {name: a.shape[0] for name, (a, _, _) in modules.items() if a.shape[0] != rank}
    alpha_pattern = {
        name: s * a.shape[0] for name, (a, _, s) in modules.items() if s * a.shape[0] != first_scale * rank
    }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": first_scale * rank,  # peft's scale is lora_alpha / r
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in modules}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
