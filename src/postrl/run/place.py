"""Where a run lives: its directory on this machine, or a URL (through fsspec) with a local copy.

A new run never writes into a place that holds a run (``--overwrite`` moves the old one aside,
never deletes it); ``--resume`` takes the saved config from the place, and a URL run first fetches
its latest complete checkpoint.
"""

from __future__ import annotations

import copy
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from postrl.config.loading import load_config
from postrl.config.location import RunLocation, is_url
from postrl.config.resume_policy import check_resume_changes, config_changes, describe_changes
from postrl.config.run import ConfigError, RunConfig
from postrl.run.checkpoint import list_checkpoints
from postrl.run.store import RunStore

PUBLISHED_AT_END = (
    "final_model",
    "reward_accuracy.png",
    "metrics.jsonl",
    "samples",
    "tensorboard",
    "reward_workers.log",
    "skipped_rows.txt",
)


class RunDirectoryError(ConfigError):
    """A new run asked to write into a directory that already holds a run."""


def _local_contents(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []


class RunPlace:
    def __init__(self, config: RunLocation) -> None:
        self.local = config.run_dir
        self.url = config.run_url
        self.store = RunStore(self.url, self.local) if self.url else None
        self.reused = False  # check_new found only the leftovers of a launch that never completed a step

    @property
    def location(self) -> str:
        """The run directory as the user names it (the URL for a URL run)."""
        return self.url or str(self.local)

    def contents(self) -> list[str]:
        return self.store.holds_a_run() if self.store else _local_contents(self.local)

    def check_new(self, overwrite: bool, command: str = "train") -> None:
        """Refuse a new run into a place that holds one, unless ``overwrite`` (which moves it aside).
        A place whose run never completed a step (a launch that failed at step 1) is reused."""
        found = self.contents()
        if not found or overwrite:
            return
        if not self.has_completed_step():
            self.reused = True  # a launch that failed before its first step: nothing of value here
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
        if self.reused and not resume:
            if self.store:
                self.store.fs.rm(self.store.root, recursive=True)
            elif self.local.exists():
                shutil.rmtree(self.local)
        if self.store and not resume and self.local.exists():
            shutil.rmtree(self.local)
        self.local.mkdir(parents=True, exist_ok=True)
        if self.store and resume:
            self.store.fetch_latest_checkpoint()

    def has_completed_step(self) -> bool:
        """Whether the run got through a step: a complete checkpoint, or a metrics row."""
        if self.completed_step() is not None:
            return True
        if self.store:
            return "metrics.jsonl" in self.store.holds_a_run()
        metrics = self.local / "metrics.jsonl"
        return metrics.is_file() and metrics.stat().st_size > 0

    def completed_step(self) -> int | None:
        """The step of the run's latest complete checkpoint (there, for a URL run), or None."""
        if self.store:
            names = self.store.complete_checkpoints()
        else:
            names = [p.name for p in list_checkpoints(self.local)]
        return int(names[-1].split("_")[1]) if names else None

    def check_resumable(self) -> int:
        """The step a resume continues from; a run without a complete checkpoint cannot be resumed."""
        done = self.completed_step()
        if done is None:
            hint = (
                "it never completed a step, so start it again with the same command (the directory is reused)"
                if not self.has_completed_step()
                else "none was written before it stopped (checkpoint.every_steps); start it anew with --overwrite"
            )
            raise FileNotFoundError(f"no complete checkpoint under {self.location}/checkpoints to resume from: {hint}")
        return done

    def drop_local_copy(self, echo: Any = print) -> None:
        """After a URL run ended well: everything is published, so the working copy goes."""
        if self.store and self.local.exists():
            shutil.rmtree(self.local, ignore_errors=True)
            echo(f"removed the working copy {self.local} (everything is at {self.url}; keep_local_copy=true keeps it)")

    def publish(self, *relatives: str) -> None:
        if self.store:
            self.store.publish(*relatives)

    def publish_checkpoint(self, checkpoint: Path, kept: list[Path]) -> None:
        if self.store:
            self.store.publish_checkpoint(checkpoint, kept)
            self.store.publish("metrics.jsonl", "samples")


def resume_config(
    run_dir: str | Path, overrides: list[str], model: type[Any] = RunConfig, force_change: list[str] | None = None
) -> Any:
    """The run's saved config (from a folder or a URL), with overrides (e.g. ``steps=200``) on top,
    validated as ``model`` (a train or a DPO run). Overrides that would change what defines the run
    are refused unless named in ``force_change`` (:mod:`postrl.config.resume_policy`); the changes are printed."""
    location = str(run_dir)
    if is_url(location):
        store = RunStore(location, Path(tempfile.gettempdir()))
        try:
            text = store.read_text("config.yaml")
        except FileNotFoundError:
            raise FileNotFoundError(f"{location} is not a run directory (no config.yaml)") from None
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(text)
            config = _resumed(Path(tmp) / "config.yaml", overrides, model, force_change or [], location)
        parent, name = location.rstrip("/").rsplit("/", 1)
        if config.run_url != location.rstrip("/"):
            config = copy.deepcopy(config)
            config.output_dir, config.name = parent, name
        return config
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    config = _resumed(path, overrides, model, force_change or [], location)
    expected = Path(run_dir).resolve()
    if config.run_dir.resolve() != expected:
        config = copy.deepcopy(config)
        config.output_dir, config.name = str(expected.parent), expected.name
    return config


def _resumed(path: Path, overrides: list[str], model: type, force_change: list[str], location: str) -> Any:
    saved = load_config(path, [], model=model, import_config_dir=False)
    if not overrides and not force_change:
        return saved
    config = load_config(path, overrides, model=model, import_config_dir=False)
    changes = config_changes(saved, config)
    check_resume_changes(changes, force_change, location)
    if changes:
        print(f"resume changes: {describe_changes(changes)}", file=sys.stderr, flush=True)
    return config


def check_steps_left(total: int, done: int, setting: str) -> None:
    """A resume may lengthen a run, never shorten it below what it has done (that would rewrite
    final_model/ and record the lower number); ``setting`` names what sets the length (``steps=N``,
    ``epochs=N``)."""
    if total < done:
        length = " is" if setting == f"steps={total}" else f" gives {total} steps,"
        raise ConfigError(
            f"{setting}{length} below the {done} this run has already done; a resume can only continue it"
        )
