"""LoRA through peft: adapters on the policy, the base model as the reference, adapter-only sync.

A weight sync sends, for every adapted linear layer, ``NAME.lora_A`` (``[r, in]``),
``NAME.lora_B`` (``[out, r]``) and ``NAME.lora_scale`` (one element), where NAME is the layer's Hugging
Face name (``model.layers.0.self_attn.q_proj``). The engine applies them unmerged,
``x W + s (x A^T) B^T``, so it computes what the trainer computes; merging ``W + s B A`` into
bf16 weights would round most of a small update away. ``model.lora.sync: merged`` sends the
merged weights instead (for engines that take whole weights only).

Under FSDP2 the adapters and the base weights are sharded (DTensors): the functions here gather
each tensor in a fixed order, so every rank of the group must call them together; each rank gets
the full tensors (on the CPU), and rank 0 sends or writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from postrl.config.run import ConfigError, LoraConfig
from postrl.models.weights import save_weights

ADAPTER = "default"


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` with trainable adapters on ``cfg.target_modules`` and every other weight frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    missing = [t for t in cfg.target_modules if not any(n.endswith(f".{t}") for n, _ in model.named_modules())]
    if missing:
        raise ConfigError(f"model.lora.target_modules: the model has no layer named {missing}")
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # annotated int; peft scales by alpha / r, a float works
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )
    return get_peft_model(model, peft_cfg)


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft model (its layers carry the adapters); ``model`` itself
    otherwise, and where peft is not installed."""
    try:
        from peft import PeftModel
    except ImportError:
        return model
    return model.get_base_model() if isinstance(model, PeftModel) else model


def lora_layers(model: Any) -> dict[str, Any]:
    """Hugging Face name of each adapted linear layer -> its peft layer (``peft.tuners.lora.LoraLayer``;
    peft is optional, hence ``Any``)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or buffer as a full, detached tensor: a sharded one (DTensor) gathered to the CPU
    (a collective), a plain one where it is."""
    if isinstance(tensor, DTensor):
        return tensor.detach().full_tensor().cpu()  # type: ignore[attr-defined]  # DTensor's, narrowed above
    return tensor.detach()


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """What an adapter-only sync sends (see the module docstring)."""
    state: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model).items():
        state[f"{name}.lora_A"] = gathered(layer.lora_A[ADAPTER].weight)
        state[f"{name}.lora_B"] = gathered(layer.lora_B[ADAPTER].weight)
        state[f"{name}.lora_scale"] = torch.tensor([float(layer.scaling[ADAPTER])])
    return state


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The base model's weights by their Hugging Face names with every adapter merged in
    (``W + s B A``, in float32, then the weight's dtype); the model itself is left as it is."""
    layers = lora_layers(model)
    base = model.get_base_model()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        module = clean.rsplit(".", 1)[0]
        tensor = gathered(tensor)
        if clean.endswith(".weight") and module in layers:
            layer = layers[module]
            delta = gathered(layer.lora_B[ADAPTER].weight).float() @ gathered(layer.lora_A[ADAPTER].weight).float()
            tensor = (tensor.float() + float(layer.scaling[ADAPTER]) * delta).to(tensor.dtype)
        state[clean] = tensor
    return state


def peft_adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters under the peft model's own state-dict names (what peft's ``save_pretrained``
    writes), gathered."""
    return {name: gathered(t) for name, t in model.state_dict().items() if ".lora_" in name}


def lora_export_state(model: Any, export: str) -> dict[str, torch.Tensor]:
    """What :func:`save_lora_model` writes, gathered (every rank of a group calls it)."""
    return peft_adapter_state(model) if export == "adapter" else merged_state(model)


def save_policy(model: Any, folder: str | Path, lora: LoraConfig | None) -> None:
    """A policy as a Hugging Face folder (config + safetensors); with LoRA merged or as an adapter
    folder (``model.lora.export``)."""
    if lora is not None:
        save_lora_model(model, Path(folder), lora.export)
        return
    save_weights(model, Path(folder))


def save_lora_model(model: Any, folder: Path, export: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """``final_model/``-style folder: merged Hugging Face weights, or peft's adapter folder.
    ``state``: :func:`lora_export_state`, already gathered (a sharded model's rank 0 passes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = lora_export_state(model, export) if state is None else state
    if export == "adapter":
        model.save_pretrained(folder, state_dict=state)
        return
    model.get_base_model().save_pretrained(folder, state_dict=state, safe_serialization=True)
