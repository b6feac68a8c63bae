"""Where a run lives: its directory on this machine, or a URL (through fsspec) with a local copy.

A new run never writes into a place that holds a run (``--overwrite`` moves the old one aside,
never deletes it); ``--resume`` takes the saved config from the place, and a URL run first fetches
its latest complete checkpoint.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from pathlib import Path

from postrl.config import ConfigError, RunConfig, load_config
from postrl.run_store import RunStore, is_url

PUBLISHED_AT_END = ("final_model", "reward_accuracy.png", "metrics.jsonl", "samples", "tensorboard",
                    "reward_workers.log", "skipped_rows.txt")


class RunDirectoryError(ConfigError):
    """A new run asked to write into a directory that already holds a run."""


def _local_contents(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []


class RunPlace:
    def __init__(self, config: RunConfig) -> None:
        self.local = config.run_dir
        self.url = config.run_url
        self.store = RunStore(self.url, self.local) if self.url else None

    @property
    def location(self) -> str:
        """The run directory as the user names it (the URL for a URL run)."""
        return self.url or str(self.local)

    def contents(self) -> list[str]:
        return self.store.holds_a_run() if self.store else _local_contents(self.local)

    def check_new(self, overwrite: bool, command: str = "train") -> None:
        """Refuse a new run into a place that holds one, unless ``overwrite`` (which moves it aside)."""
        found = self.contents()
        if not found or overwrite:
            return
        raise RunDirectoryError(
            f"run directory {self.location} already holds a run ({', '.join(found[:6])}). "
            f"Continue it with `postrl {command} --resume {self.location}`, start a new one with a new name (name=NEW), "
            f"or pass --overwrite to move the old run aside to {self.location}.old-<time>"
        )

    def move_aside(self) -> str | None:
        """Rename an existing run to ``NAME.old-YYYYmmdd-HHMMSS`` (never deletes it)."""
        if not self.contents():
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if self.store:
            return self.store.move_aside(stamp)
        target = self.local.with_name(f"{self.local.name}.old-{stamp}")
        i = 1
        while target.exists():
            i += 1
            target = self.local.with_name(f"{self.local.name}.old-{stamp}-{i}")
        self.local.rename(target)
        return str(target)

    def prepare(self, resume: bool) -> None:
        """Create the local directory; a new URL run starts from an empty local copy, a resumed one
        fetches its latest complete checkpoint and metrics."""
        if self.store and not resume and self.local.exists():
            shutil.rmtree(self.local)
        self.local.mkdir(parents=True, exist_ok=True)
        if self.store and resume:
            self.store.fetch_latest_checkpoint()

    def publish(self, *relatives: str) -> None:
        if self.store:
            self.store.publish(*relatives)

    def publish_checkpoint(self, checkpoint: Path, kept: list[Path]) -> None:
        if self.store:
            self.store.publish_checkpoint(checkpoint, kept)
            self.store.publish("metrics.jsonl", "samples")


def resume_config(run_dir: str | Path, overrides: list[str], model: type = RunConfig) -> RunConfig:
    """The run's saved config (from a folder or a URL), with overrides (e.g. ``steps=200``) on top,
    validated as ``model`` (a train or a DPO run)."""
    location = str(run_dir)
    if is_url(location):
        store = RunStore(location, Path(tempfile.gettempdir()))
        try:
            text = store.read_text("config.yaml")
        except FileNotFoundError:
            raise FileNotFoundError(f"{location} is not a run directory (no config.yaml)") from None
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(text)
            config = load_config(Path(tmp) / "config.yaml", overrides, model=model, import_config_dir=False)
        parent, name = location.rstrip("/").rsplit("/", 1)
        if config.run_url != location.rstrip("/"):
            config = copy.deepcopy(config)
            config.output_dir, config.name = parent, name
        return config
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(path, overrides, model=model, import_config_dir=False)
    expected = Path(run_dir).resolve()
    if config.run_dir.resolve() != expected:
        config = copy.deepcopy(config)
        config.output_dir, config.name = str(expected.parent), expected.name
    return config
