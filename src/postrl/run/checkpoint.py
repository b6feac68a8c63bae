"""Atomic run-state checkpoints and exact resume.

A checkpoint is written into ``checkpoints/.step_N.tmp``, completed with a ``COMPLETE`` marker,
then renamed to ``checkpoints/step_N`` in one ``rename``. A folder without the marker (a process
killed mid-write) is never loaded, so the previous checkpoint stays usable.
"""

from __future__ import annotations

import json
import os
import shutil
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
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    trainer.save_checkpoint(tmp)
    if critic is not None:
        critic.save_checkpoint(tmp / "critic")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    torch.save(run_state, tmp / "run_state.pt")
    (tmp / "run_state.json").write_text(
        json.dumps({k: v for k, v in run_state.items() if k in ("step", "weight_version", "sampler")})
    )
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
