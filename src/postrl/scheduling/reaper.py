"""Nothing of a Ray instance started for a run may outlive the run's driver, however it dies.

Ray's own fate sharing covers the GCS server and the raylet, not the agents the raylet starts
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``, which ignore SIGTERM) nor idle workers. So
before a local Ray instance is started, the driver marks its environment with a token that every
Ray process inherits, and starts a reaper: a small process in its own session that holds the read
end of a pipe from the driver and notes, twice a second, every process below the driver and every
process below a marked one. The second net matters: a process that sets its title (the agents do)
may overwrite the start of its environment, and with it the token. When the pipe closes, the
reaper kills every marked process and every process it saw below one, and everything below those;
when the driver did not say goodbye first (it crashed or was killed with SIGKILL), also every
process it saw below the driver.

Run as ``python -m postrl.scheduling.reaper TOKEN DRIVER_PID``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

MARKER = "POSTRL_RAY_OWNER"
GOODBYE = b"bye"  # what a driver that closes cleanly writes before closing the pipe


def marked_processes(token: str, exclude: set[int]) -> list[int]:
    """PIDs of live processes whose environment holds ``MARKER=token`` (other users' are unreadable)."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def descendants(roots: set[int]) -> dict[int, int]:
    """``{pid: start time}`` of every live process below ``roots`` (the roots included)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                table[int(entry.name)] = stat
    found = {pid: table[pid][1] for pid in roots if pid in table}
    grew = True
    while grew:
        grew = False
        for pid, (parent, start) in table.items():
            if parent in found and pid not in found:
                found[pid] = start
                grew = True
    return found


def kill_marked(token: str, exclude: set[int], known: dict[int, int] | None = None, rounds: int = 20) -> int:
    """SIGKILL every marked process and every process seen below the driver (``known``: pid ->
    start time, so a reused pid is spared) with what runs below them, again until none is left
    (a dying raylet may start one more)."""
    killed = 0
    for _ in range(rounds):
        alive = {pid for pid, start in (known or {}).items() if (_stat(pid) or (0, -1))[1] == start}
        pids = set(marked_processes(token, exclude)) | alive
        pids = set(descendants(pids)) - exclude
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.25)
    return killed


class Reaper:
    """The driver's side: marks this process's environment and starts the reaper process."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != MARKER}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "postrl.scheduling.reaper", self.token, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        os.environ[MARKER] = self.token  # what Ray starts from here on inherits it

    def close(self) -> None:
        """After ``ray.shutdown``: let the reaper sweep what is left, and wait for it briefly."""
        if os.environ.get(MARKER) == self.token:
            del os.environ[MARKER]
        if self.process.stdin is not None:
            try:
                self.process.stdin.write(GOODBYE)
                self.process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass


def _watch(token: str, driver: int) -> tuple[dict[int, int], dict[int, int], bool]:
    """Until the driver's pipe closes: (processes seen below the driver, processes seen below a
    marked one, whether the driver said goodbye), each seen process with its start time."""
    below_driver: dict[int, int] = {}
    below_marked: dict[int, int] = {}
    said = b""
    me = os.getpid()
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], 0.5)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                return below_driver, below_marked, said == GOODBYE
            said += chunk
        below_driver.update(descendants({driver}))
        below_marked.update(descendants(set(marked_processes(token, {me, driver}))))
        for pid in (me, driver):
            below_driver.pop(pid, None)
            below_marked.pop(pid, None)


def main(argv: list[str]) -> int:
    token, driver = argv[0], int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver is not for the reaper
    below_driver, below_marked, clean = _watch(token, driver)
    # after a clean close (the driver lives on) only Ray's processes go; when the driver died
    # without a goodbye, everything it left below it goes too (its pipe closes before it is gone,
    # so asking /proc whether it is dead would race)
    known = below_marked if clean else {**below_driver, **below_marked}
    kill_marked(token, exclude={os.getpid(), driver}, known=known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
