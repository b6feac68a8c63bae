"""The ``code`` reward: run the response's program against the row's tests in the sandbox.

Runs inside a scoring worker process (see :mod:`postrl.reward.pool`), which starts one sandboxed
subprocess per program. Tests come from a dataset column in one of these shapes (or a JSON string
of one): a list of Python statements (``["assert f(1) == 2", ...]``), a list of
``{"input": ..., "output": ...}`` stdin/stdout cases, or ``{"inputs": [...], "outputs": [...]}``.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from postrl.reward.sandbox import Protections, Sandbox, SandboxLimits, SandboxUnavailableError

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    """The last fenced ```python block, else the last fenced block of any language, else the text."""
    blocks = _FENCE.findall(response)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return response


def parse_tests(value: Any) -> tuple[str, list]:
    """(mode, tests) from a tests column; raises ValueError naming what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tests column is a string but not JSON: {exc}") from None
    if isinstance(value, dict) and "inputs" in value and "outputs" in value:
        if len(value["inputs"]) != len(value["outputs"]):
            raise ValueError(f"tests column has {len(value['inputs'])} inputs but {len(value['outputs'])} outputs")
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"])]
    if not isinstance(value, list) or not value:
        raise ValueError("tests column must be a non-empty list of assert statements or {input, output} cases")
    if all(isinstance(t, str) for t in value):
        return "assert", value
    if all(isinstance(t, dict) and "input" in t and "output" in t for t in value):
        return "io", [{"input": str(t["input"]), "output": str(t["output"])} for t in value]
    raise ValueError("tests column mixes shapes: use all assert strings or all {input, output} cases")


@lru_cache(maxsize=8)
def _sandbox(limits: SandboxLimits, namespaces: tuple[str, ...] | None, user: tuple[int, int] | None) -> Sandbox:
    if namespaces is None:
        return Sandbox(limits)  # no probe result handed over: probe here
    return Sandbox(limits, Protections(namespaces, user))


def code_reward(
    prompt: str,
    response: str,
    tests_column: str = "tests",
    code_score: str = "fraction",
    sandbox: dict | None = None,
    protections: dict | None = None,
    **columns: Any,
) -> tuple[float, str | None]:
    """(fraction of tests passed, or 1/0 with code_score='all_or_nothing'; why tests failed).

    A malformed tests column raises (the sample is unscorable, the error is kept), as does a
    sandbox that could not start the cases (another jail's fork bomb held the sandbox user's
    process limit); anything the program does only fails tests, and the reason is reported with
    the score.
    """
    if tests_column not in columns:
        raise KeyError(f"row has no '{tests_column}' column with tests for the code reward")
    mode, tests = parse_tests(columns[tests_column])
    namespaces = tuple(protections["namespaces"]) if protections else None
    user = tuple(protections["user"]) if protections and protections.get("user") else None
    result = _sandbox(SandboxLimits(**(sandbox or {})), namespaces, user).run(extract_program(response), tests, mode)
    if result.unavailable:
        raise SandboxUnavailableError(f"code sandbox: {result.error}")
    failures = [f"test {i}: {err}" for i, (ok, err) in enumerate(zip(result.passed, result.errors)) if not ok]
    reason = result.error or ("; ".join(failures[:3]) if failures else None)
    if code_score == "all_or_nothing":
        return (1.0 if all(result.passed) else 0.0), reason
    return result.fraction, reason
