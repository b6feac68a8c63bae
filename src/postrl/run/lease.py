"""One Controller per run directory: a lease file that a second live Controller is refused by.

The lease names its holder (host, pid, the process's start time, a random token) and is renewed
by a heartbeat. A holder on this host is live while its process is (pid reuse is caught by the
start time); a holder elsewhere is live while its heartbeat is fresh. A dead holder's lease is
taken over, with a message. The file goes through fsspec, like the rest of the run's state.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec

from postrl.config.run import ConfigError

LEASE_FILE = "controller.lease"


class LeaseHeldError(ConfigError):
    """Another live Controller holds the run directory."""


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/pid/stat), None when it is not running."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:  # no /proc (not Linux): only whether the process exists can be told
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "unknown"


class RunLease:
    def __init__(self, run_dir: str | Path, ttl_s: float = 60.0, heartbeat_s: float = 10.0) -> None:
        self.run_dir = str(run_dir)
        self.path = f"{self.run_dir.rstrip('/')}/{LEASE_FILE}"
        self.fs, self.fs_path = fsspec.core.url_to_fs(self.path)
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        try:
            with self.fs.open(self.fs_path, "r") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return {"host": "?", "pid": -1, "heartbeat": 0.0, "token": "unreadable"}

    def is_live(self, holder: dict[str, Any]) -> bool:
        if holder.get("host") == socket.gethostname() and holder.get("pid", -1) > 0:
            started = process_start_time(int(holder["pid"]))
            return started is not None and started in (holder.get("started"), "unknown")
        return time.time() - float(holder.get("heartbeat", 0.0)) < self.ttl_s

    def check_free(self) -> dict[str, Any] | None:
        """Raise when a live Controller holds the run; return a dead holder's record (or None)."""
        holder = self.holder()
        if holder is not None and holder.get("token") != self.token and self.is_live(holder):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0))))
            raise LeaseHeldError(
                f"run directory {self.run_dir} is in use by another postrl controller (pid {holder.get('pid')} on "
                f"host {holder.get('host')}, since {since}). Wait for it to finish or stop it (Ctrl-C checkpoints "
                f"and exits); its lease is taken over automatically once that process has ended"
            )
        return holder

    def acquire(self, echo: Callable[[str], None] = print) -> None:
        previous = self.check_free()
        self._write(since=time.time())
        if (self.holder() or {}).get("token") != self.token:
            raise LeaseHeldError(f"another controller took run directory {self.run_dir} at the same moment")
        if previous is not None:
            echo(
                f"took over {self.run_dir} from a controller that is no longer running "
                f"(pid {previous.get('pid')} on host {previous.get('host')})"
            )
        self._thread = threading.Thread(target=self._beat, name="postrl-lease", daemon=True)
        self._thread.start()

    def _write(self, since: float) -> None:
        pid = os.getpid()
        record = {
            "host": socket.gethostname(),
            "pid": pid,
            "started": process_start_time(pid),
            "token": self.token,
            "since": since,
            "heartbeat": time.time(),
        }
        self.fs.makedirs(self.fs._parent(self.fs_path), exist_ok=True)
        with self.fs.open(self.fs_path, "w") as f:
            f.write(json.dumps(record))
        self._since = since

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if (self.holder() or {}).get("token") == self.token:
                self._write(self._since)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if (self.holder() or {}).get("token") == self.token:
            self.fs.rm(self.fs_path)
