"""A scoring worker process: reads JSON jobs from stdin, writes one JSON result per job to stdout.

Run as ``python -m postrl.reward.worker [module:function ...]`` (the functions are imported
before the worker reports ready, so their import time does not count against a job's timeout). Each job names a function by import path; the
function's exceptions become error results. A function returns a number, None (cannot score),
or ``(number, reason)``, where the reason (e.g. which test failed and why) is reported with the score. Nothing is unpickled: the pipe speaks JSON lines.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

_cache: dict[str, Callable[..., Any]] = {}


def resolve(path: str) -> Callable[..., Any]:
    if path not in _cache:
        module_name, _, attr = path.partition(":")
        fn = getattr(importlib.import_module(module_name), attr, None)
        if not callable(fn):
            raise ImportError(f"'{path}': module '{module_name}' has no callable '{attr}'")
        _cache[path] = fn
    return _cache[path]


def check_value(value: Any) -> str | None:
    """Why ``value`` is not a usable score, or None. Numbers only: a bool or a string is a bug in the
    reward function, never converted."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_numeric_scalar(value):
        return f"returned {type(value).__name__} {value!r:.80}, not a number (return a float, None, or (float, reason))"
    if not math.isfinite(float(value)):
        return f"returned {float(value)} (not finite)"
    return None


def _is_numeric_scalar(value: Any) -> bool:
    """numpy/torch scalars (anything with a real-number ``item()``), but not strings or bools."""
    item = getattr(value, "item", None)
    if not callable(item) or getattr(value, "ndim", 0) not in (0, None):
        return False
    try:
        inner = item()
    except Exception:  # noqa: BLE001
        return False
    return isinstance(inner, (int, float)) and not isinstance(inner, bool)


def die_with_parent() -> None:
    """Exit when the process that started this worker goes away, even while a reward function
    hangs: a parent-death signal on Linux, and a watchdog thread elsewhere (and as a backstop)."""
    import signal
    import threading
    import time

    parent = int(os.environ.get("POSTRL_POOL_PID") or 0)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if not parent:
        return
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="postrl-parent-watch", daemon=True).start()


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    try:
        fn = resolve(job["fn"])
        columns = dict(job.get("columns") or {})
        columns.update(job.get("options") or {})
        value = fn(job["prompt"], job["response"], **columns)
        reason = None
        if isinstance(value, tuple) and len(value) == 2:
            value, reason = value
            reason = None if reason is None else str(reason)[:1000]
        if value is None:
            return {"id": job["id"], "value": None, "error": f"{job['fn']} returned None (cannot score)"}
        problem = check_value(value)
        if problem:
            return {"id": job["id"], "value": None, "error": f"{job['fn']} {problem}"}
        value = float(value)
        return {"id": job["id"], "value": value, "error": None, "reason": reason}
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded, unscorable result
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        return {"id": job["id"], "value": None, "error": f"{type(exc).__name__}: {exc}{where}"}


def main() -> None:
    # results go to a private copy of the pipe; fd 1 (and sys.stdout) now point at stderr, so
    # neither a reward function's prints nor a C library writing to fd 1 can corrupt the stream
    die_with_parent()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for path in sys.argv[1:]:
        try:
            warm = getattr(resolve(path), "preload", None)  # a function may name imports to do up front
            if callable(warm):
                warm()
        except Exception:  # noqa: BLE001 - reported again, per job, when the function is used
            pass
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(run_job(json.loads(line))) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
