"""Moving weights: saving/loading safetensors folders and syncing the trainer's policy into rollout workers.

``rollout.weight_sync`` picks the transport: ``memory`` hands the state dict to each engine (the
engine copies it into its own parameters), ``safetensors`` writes one file that every engine
loads by path (see :func:`write_sync_file`), ``broadcast`` sends it over a torch.distributed group
(:mod:`postrl.rollout.broadcast`, :mod:`postrl.rollout.weight_transport`).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from postrl.workers.errors import remote_error


def tied_keys(model: torch.nn.Module) -> set[str]:
    config = getattr(model, "config", None)
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


def save_weights(model: torch.nn.Module, folder: Path) -> None:
    """A Hugging Face folder (config + safetensors) that ``from_pretrained`` can load."""
    model.save_pretrained(folder, safe_serialization=True)


def load_state_checked(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model`` only after every name and shape was checked: never half-load."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and k not in tied_keys(model)]
    unexpected = [k for k in state if k not in own]
    wrong_shape = [
        f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}"
        for k in state
        if k in own and state[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong_shape:
        raise RuntimeError(
            f"weights from {source} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {wrong_shape[:5]}"
        )
    model.load_state_dict(state, strict=False)


def dedupe_tied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of tensors that share storage (tied embeddings are sent once)."""
    seen: set[int] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor.detach()
    return unique


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names in a safetensors file (its header only)."""
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def write_sync_file(state: dict[str, torch.Tensor], path: Path) -> Path:
    """Write a state dict as one safetensors file (tied tensors de-duplicated), atomically."""
    unique = {name: t.contiguous() for name, t in dedupe_tied(state).items()}
    tmp = path.with_suffix(".tmp")
    save_file(unique, str(tmp))
    tmp.replace(path)
    return path


@remote_error
class WeightSyncError(RuntimeError):
    """The weights that reached a rollout worker are not the weights that were sent."""


def tensor_checksum(tensor: torch.Tensor) -> str:
    """CRC32 of a tensor's bytes, with its dtype and shape: cheap corruption detection, not security."""
    t = tensor.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    crc = zlib.crc32(raw.numpy().data) if raw.numel() else 0
    return f"{str(t.dtype).removeprefix('torch.')}:{'x'.join(map(str, t.shape))}:{crc:08x}"


def weight_manifest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in state.items()}


def verify_manifest(state: dict[str, torch.Tensor], manifest: dict[str, str]) -> None:
    """Raise WeightSyncError naming every tensor that is missing, extra or altered."""
    missing = sorted(set(manifest) - set(state))
    extra = sorted(set(state) - set(manifest))
    altered = [n for n in manifest if n in state and tensor_checksum(state[n]) != manifest[n]]
    if missing or extra or altered:
        raise WeightSyncError(
            f"weight sync check failed: {len(altered)} tensors altered {altered[:3]}, "
            f"{len(missing)} missing {missing[:3]}, {len(extra)} unexpected {extra[:3]}"
        )
