"""Atomic run-state checkpoints and exact resume.

A checkpoint is written into ``checkpoints/.step_N.tmp``, completed with a ``COMPLETE`` marker,
then renamed to ``checkpoints/step_N`` in one ``rename``. A folder without the marker (a process
killed mid-write) is never loaded, so the previous checkpoint stays usable.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path,
    step: int,
    trainer: Any,
    run_state: dict[str, Any],
    keep_last: int = 2,
    tokenizer: Any = None,
    critic: Any = None,
) -> Path:
    """``tokenizer`` is saved into the checkpoint's ``model/`` folder, which then loads like any model
    folder (``postrl serve-rollout``/``eval``, ``model.path``, ``AutoModelForCausalLM``)."""

    def write(tmp: Path) -> None:
        _write_policy(tmp, trainer, tokenizer, critic)
        _write_state(tmp, run_state)

    return _atomically(run_dir, step, keep_last, write)


def save_policies_checkpoint(
    run_dir: Path, step: int, policies: dict[str, tuple[Any, dict[str, Any], Any, Any]], keep_last: int = 2
) -> Path:
    """A run with several policies: each policy's (trainer, run state, tokenizer, critic) under
    ``policies/NAME`` of one checkpoint, completed at once (a resume never mixes two steps)."""

    def write(tmp: Path) -> None:
        for name, (trainer, _, tokenizer, critic) in policies.items():
            _write_policy(tmp / "policies" / name, trainer, tokenizer, critic)
        states = {name: state for name, (_, state, _, _) in policies.items()}
        versions = [int(state["weight_version"]) for state in states.values()]
        _write_state(tmp, {"step": step, "weight_version": min(versions), "policies": states})

    return _atomically(run_dir, step, keep_last, write)


def _write_policy(folder: Path, trainer: Any, tokenizer: Any, critic: Any) -> None:
    trainer.save_checkpoint(folder)
    if critic is not None:
        critic.save_checkpoint(folder / "critic")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder / "model")


def _write_state(folder: Path, run_state: dict[str, Any]) -> None:
    torch.save(run_state, folder / "run_state.pt")
    (folder / "run_state.json").write_text(
        json.dumps({k: v for k, v in run_state.items() if k in ("step", "weight_version", "sampler")})
    )


def _atomically(run_dir: Path, step: int, keep_last: int, write: Callable[[Path], None]) -> Path:
    """``write`` fills ``checkpoints/.step_N.tmp``; marked complete, it becomes ``step_N`` in one rename."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    (tmp / MARKER).write_text("ok\n")
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete or temporary folders are ignored."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_run_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / "run_state.pt", weights_only=True)
