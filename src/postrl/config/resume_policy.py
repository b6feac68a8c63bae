"""What a resume may change in a run's saved config.

A resumed run must stay the run it was: the model, the data, the algorithm and the seed define it
(changing the base model under a run changes its KL reference; another seed another sampler
order), so such a change is refused, naming the field and both values, unless the user says
``--force-change FIELD``. How long it runs (``steps``, ``epochs``: upward only, checked against
the steps done), where and how it logs, checkpoints and places its workers, and the timeouts may
change freely. Every change is printed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# fields (or whole sections, ending in '.') a resume may change without --force-change
FREE_TO_CHANGE = (
    "steps",
    "epochs",
    "output_dir",
    "name",
    "import_paths",
    "logging.",
    "checkpoint.",
    "scheduler.",
    "train.device",
    "train.max_consecutive_nan",
    "rollout.device",
    "rollout.max_batch_size",
    "rollout.url",
    "rollout.api_key_env",
    "rollout.sync_dir",
    "rollout.weight_sync",
    "rollout.sync_bucket_mb",
    "rollout.verify_sync",
    "rollout.vllm.startup_timeout_s",
    "rollout.vllm.request_timeout_s",
    "reward.timeout_s",
    "reward.num_workers",
    "reward.max_workers",
    "reward.stall_after_s",
    "reward.hang_limit",
    "reward.max_failure_rate",
    "reward.remote.",
    "data.val_files",
    "data.val_size",
)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of nested mappings (lists stay whole values)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def _matches(field: str, rules: tuple[str, ...] | list[str]) -> bool:
    return any(field == r or field.startswith(r if r.endswith(".") else r + ".") for r in rules)


def config_changes(saved: BaseModel, new: BaseModel) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, new value)`` for every field that differs."""
    before, after = flatten(saved.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    return [(k, before.get(k), after.get(k)) for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]


def check_resume_changes(changes: list[tuple[str, Any, Any]], force: list[str], run: str) -> None:
    """Refuse changes to what defines the run, unless forced (a field or a section name)."""
    from postrl.config.run import ConfigError

    refused = [(k, a, b) for k, a, b in changes if not _matches(k, FREE_TO_CHANGE) and not _matches(k, force)]
    if refused:
        lines = "\n  ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in refused)
        flags = " ".join(f"--force-change {k}" for k, _, _ in refused)
        raise ConfigError(
            f"--resume {run} would change what defines the run:\n  {lines}\nA resumed run keeps its "
            f"model, data, algorithm and seed; start a new run (name=NEW), or pass {flags} "
            "if you mean it"
        )
    unknown = [f for f in force if not any(_matches(k, [f]) for k, _, _ in changes)]
    if unknown:
        raise ConfigError(f"--force-change {', '.join(unknown)}: no such change in this resume")


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes)
