"""A run directory at a URL (``output_dir: s3://bucket/runs``, ``gs://``, ``file://``... any fsspec
filesystem; install its extra, e.g. ``s3fs``): the run works in a local copy and publishes its
state there through fsspec as it becomes complete.

What is published, and when: ``config.yaml`` at the start; every checkpoint once it is complete
(its ``COMPLETE`` marker last, so a reader never sees half a checkpoint, and pruned checkpoints
are deleted there too) together with ``metrics.jsonl`` and the samples; at the end
``final_model/``, the plot and TensorBoard. ``--resume URL`` reads the config there and fetches
the latest complete checkpoint and the metrics before continuing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec

MARKER = "COMPLETE"


class RunStore:
    def __init__(self, run_url: str, local_dir: Path) -> None:
        self.url = run_url.rstrip("/")
        self.local = Path(local_dir)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def _remote(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def holds_a_run(self) -> list[str]:
        if not self.fs.isdir(self.root):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))

    def publish(self, *relatives: str) -> None:
        """Copy files or folders (relative to the run) from the local copy to the URL."""
        for relative in relatives:
            source = self.local / relative
            if source.is_dir():
                self._put_folder(source, relative)
            elif source.is_file():
                self._put_file(source, self._remote(relative))

    def _put_folder(self, source: Path, relative: str, marker_last: bool = False) -> None:
        files = sorted(p for p in source.rglob("*") if p.is_file())
        if marker_last:
            files.sort(key=lambda p: p.name == MARKER)
        for path in files:
            self._put_file(path, self._remote(f"{relative}/{path.relative_to(source).as_posix()}"))

    def fetch_folder(self, relative: str) -> Path | None:
        """Download a folder of the run (e.g. ``final_model``) into the local copy; None when absent."""
        prefix = self._remote(relative)
        if not self.fs.isdir(prefix):
            return None
        target = self.local / relative
        for remote in self.fs.find(prefix):
            local = target / remote[len(prefix) :].lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(local))
        return target

    def _put_file(self, source: Path, target: str) -> None:
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.put_file(str(source), target)

    def publish_checkpoint(self, checkpoint: Path, kept: list[Path]) -> None:
        """A complete checkpoint, marker last; then remove checkpoints pruned locally."""
        self._put_folder(checkpoint, f"checkpoints/{checkpoint.name}", marker_last=True)
        keep = {p.name for p in kept}
        root = self._remote("checkpoints")
        for path in self.fs.ls(root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step_") and name not in keep:
                self.fs.rm(path, recursive=True)

    def read_text(self, relative: str) -> str:
        with self.fs.open(self._remote(relative), "r") as f:
            return f.read()

    def complete_checkpoints(self) -> list[str]:
        """The names of the run's complete checkpoints there, oldest first."""
        root = self._remote("checkpoints")
        names = (
            [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(root, detail=False)] if self.fs.isdir(root) else []
        )
        return sorted(
            (n for n in names if n.startswith("step_") and self.fs.isfile(f"{root}/{n}/{MARKER}")),
            key=lambda n: int(n.split("_")[1]),
        )

    def fetch_latest_checkpoint(self) -> str | None:
        """Download the latest complete checkpoint (and metrics.jsonl) into the local copy."""
        root = self._remote("checkpoints")
        complete = self.complete_checkpoints()
        for relative in ("metrics.jsonl",):
            if self.fs.isfile(self._remote(relative)):
                self.local.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self._remote(relative), str(self.local / relative))
        if not complete:
            return None
        target = self.local / "checkpoints" / complete[-1]
        if not (target / MARKER).is_file():
            if target.exists():
                shutil.rmtree(target)
            prefix = f"{root}/{complete[-1]}/"
            for remote in self.fs.find(prefix):
                local = target / remote[len(prefix) :]
                local.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(remote, str(local))
        return complete[-1]

    def move_aside(self, stamp: str) -> str:
        target = f"{self.root}.old-{stamp}"
        self.fs.mv(self.root, target, recursive=True)
        return target
