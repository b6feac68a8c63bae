"""Sharded training state on disk: torch.distributed.checkpoint (DCP) for the model and optimizer.

DCP writes every rank's shards with a global layout, so a checkpoint written by N ranks loads into
M ranks (or one plain process) and comes back as the same full tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def full_tensor(value: Any) -> Any:
    """A DTensor (FSDP2's sharded or replicated tensor) as the full local tensor; anything else as is."""
    gather = getattr(value, "full_tensor", None)
    return gather() if gather is not None else value


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns when it runs without a process group; for a one-process trainer that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_is_intended():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))


def load_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load into the current layout (sharded or not) whatever layout wrote ``folder``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
