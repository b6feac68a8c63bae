"""``module:name`` references in a config (a custom reward's function, ``agent.env``,
``agent.function``), resolved when the config is read, so that a typo is a one-line error naming
the field before anything is written."""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def import_callable(spec: str, field: str) -> Callable[..., Any]:
    """``module:attribute`` imported. A ValueError naming ``field`` when the module is missing or
    fails to import (with the file and line), or lacks the attribute (listing what it has)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{field}: expected module:name, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(
                f"{field}={spec!r}: no module named '{exc.name}' (looked in the config's folder, the working "
                "directory, import_paths and the installed packages)"
            ) from None
        raise ValueError(f"{field}={spec!r}: importing module '{module_name}' failed: {_reason(exc)}") from None
    except Exception as exc:  # the module's own code raised while it was imported
        raise ValueError(f"{field}={spec!r}: importing module '{module_name}' failed: {_reason(exc)}") from None
    found = getattr(module, attr, None)
    if found is None:
        where = getattr(module, "__file__", None) or module_name
        raise ValueError(f"{field}={spec!r}: module '{module_name}' ({where}) has no '{attr}'; {_contents(module)}")
    if not callable(found):
        raise ValueError(
            f"{field}={spec!r}: '{attr}' in module '{module_name}' is a {type(found).__name__}, not a class or function"
        )
    return found


def _contents(module: Any) -> str:
    """The classes and functions defined in ``module`` itself."""
    own = sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module.__name__
    )
    return f"it has: {', '.join(own)}" if own else "it defines no classes or functions"


def _reason(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename and not f.filename.startswith("<frozen")]
    where = f" ({Path(user[-1].filename).name}:{user[-1].lineno})" if user else ""
    return f"{type(exc).__name__}: {exc}{where}"
