"""The data columns each reward component needs, checked against the data before a run starts.

A component that needs a column the data lacks would otherwise fail at step 1, after the run
directory was written: ``exact_match`` and ``math`` need their ``answer_column``, ``code`` its
``tests_column``, and a custom ``score(prompt, response, answer)`` every parameter it names
without a default (unless it also takes ``**columns``, which cannot be checked).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

from postrl.config.run import ConfigError, RewardConfig

ALWAYS_PASSED = ("prompt", "response")


def function_columns(path: str) -> list[str]:
    """The columns ``module:function`` requires: its parameters after prompt and response that have
    no default (keyword-only ones too)."""
    module_name, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or a callable without a signature: nothing to check
        return []
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [p.name for p in named[len(ALWAYS_PASSED) :] if p.default is p.empty]


def required_columns(config: RewardConfig) -> dict[str, list[str]]:
    """``{component name: columns it needs}``."""
    needs: dict[str, list[str]] = {}
    for comp in config.components:
        if comp.type in ("exact_match", "math"):
            needs[comp.name] = [comp.answer_column]
        elif comp.type == "code":
            needs[comp.name] = [comp.tests_column]
        elif comp.type == "custom":
            needs[comp.name] = function_columns(comp.function)
        if comp.applies_to is not None:
            needs.setdefault(comp.name, []).append("task_type")
    return {name: cols for name, cols in needs.items() if cols}


def check_columns(config: RewardConfig, rows: Iterable[tuple[str, dict[str, Any]]]) -> None:
    """Every row (``(source, columns)``) a component applies to has the columns it needs; the first
    rows missing one are named."""
    needs = required_columns(config)
    if not needs or config.remote is not None:
        return
    by_name = {c.name: c for c in config.components}
    missing: dict[tuple[str, str], list[str]] = {}
    for source, columns in rows:
        for name, cols in needs.items():
            comp = by_name[name]
            if comp.applies_to is not None and columns.get("task_type") not in comp.applies_to:
                continue
            for col in cols:
                if col not in columns:
                    missing.setdefault((name, col), []).append(source)
    if missing:
        lines = []
        for (name, col), sources in missing.items():
            comp = by_name[name]
            what = f"{comp.function} takes '{col}'" if comp.type == "custom" else f"it reads '{col}'"
            more = f" and {len(sources) - 3} more" if len(sources) > 3 else ""
            lines.append(f"reward component '{name}' ({comp.type}): {what}, missing in {', '.join(sources[:3])}{more}")
        raise ConfigError(
            "the data lacks columns the reward needs:\n  "
            + "\n  ".join(lines)
            + "\n(add the column to the data, or set the component's answer_column / tests_column)"
        )
