"""Where a run lives: a local run directory, or a URL (s3://, gs://, file://...) and its local copy."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def is_url(location: str) -> bool:
    return "://" in location


def local_copy_dir(run_url: str, name: str) -> Path:
    """Where a URL run works on this machine (``POSTRL_RUN_CACHE``, default ~/.cache/postrl/runs)."""
    root = Path(os.environ.get("POSTRL_RUN_CACHE", "~/.cache/postrl/runs")).expanduser()
    return root / f"{name}-{hashlib.sha1(run_url.encode()).hexdigest()[:12]}"


class RunLocation:
    """``run_url`` and ``run_dir`` of a config with ``output_dir`` and ``name`` (train and dpo runs)."""

    output_dir: str
    name: str

    @property
    def run_url(self) -> str | None:
        """The run directory when ``output_dir`` is a URL (s3://, gs://, file://...), else None."""
        return f"{self.output_dir.rstrip('/')}/{self.name}" if is_url(self.output_dir) else None

    @property
    def run_dir(self) -> Path:
        """Where the run writes on this machine: the run directory, or a URL run's local copy."""
        if self.run_url is not None:
            return local_copy_dir(self.run_url, self.name)
        return Path(self.output_dir) / self.name
