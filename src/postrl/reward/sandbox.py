"""The code sandbox: runs a model-written Python program against tests in a jailed subprocess.

Each run is a fresh process (``sandbox_harness.py``) in its own session and process group, with
a wall-clock timeout that kills the whole group, limits on CPU time, address space, processes,
file size and open files, a scrubbed environment, stdin closed, output capped, and a fresh
working directory that is removed afterwards. Where the kernel allows, it also gets new network
(no network at all), PID (everything it forks dies with it) and mount (a private /tmp) namespaces
via ``unshare``, and it drops to an unprivileged user when the service runs as root.
``probe_protections`` says which of these are active on this machine; the service logs them at
start and warns, by name, about each one that is missing.
"""

from __future__ import annotations

import marshal
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from postrl.reward.sandbox_harness import EX_TEMPFAIL
from postrl.workers.process import pdeathsig_prefix

HARNESS = Path(__file__).with_name("sandbox_harness.py")
SCRUBBED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
}


class SandboxUnavailableError(RuntimeError):
    """The sandbox could not run a program's cases at all: the sample is unscorable, not failed."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 64
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20
    tmp_size_mb: int = 64
    python_site: bool = False  # False: the program sees the standard library only (faster start)


@dataclass
class SandboxResult:
    passed: list[bool]
    errors: list[str | None]
    error: str | None = None  # a failure of the whole run (timeout, output cap, crash before tests)
    timed_out: bool = False
    output: str = ""  # the first bytes of stdout + stderr, for debugging
    # io cases could not be run at all (the sandbox user's process limit, shared by every jail,
    # held by another program throughout): the verdicts say nothing about this program
    unavailable: bool = False

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


@dataclass(frozen=True)
class Protections:
    namespaces: tuple[str, ...]  # the unshare flags that work here
    unprivileged_user: tuple[int, int] | None  # (uid, gid) to drop to, when running as root
    active: dict[str, bool] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [name for name, on in self.active.items() if not on]


_NAMESPACE_FLAGS = {"network_namespace": "--net", "pid_namespace": "--pid", "mount_namespace": "--mount"}


@lru_cache(maxsize=1)
def probe_protections() -> Protections:
    """Find which namespaces ``unshare`` can create here and whether to drop privileges."""
    is_root = os.geteuid() == 0
    base = ["unshare"] if is_root else ["unshare", "--user", "--map-root-user"]
    working: list[str] = []
    if shutil.which("unshare"):
        for flag in _NAMESPACE_FLAGS.values():
            extra = ["--fork", "--kill-child"] if flag == "--pid" else []
            probe = [*base, *working, flag, *extra, "true"]
            try:
                ok = subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if ok:
                working.append(flag)
    user = None
    if is_root:
        try:
            nobody = pwd.getpwnam("nobody")
            user = (nobody.pw_uid, nobody.pw_gid)
        except KeyError:
            user = (65534, 65534)
    active = {
        "process_group_kill": True,
        "resource_limits": True,
        "scrubbed_environment": True,
        "closed_stdin": True,
        "output_cap": True,
        "fresh_working_directory": True,
        **{name: flag in working for name, flag in _NAMESPACE_FLAGS.items()},
        # only a service started as root can run programs as another user (nobody); otherwise they run
        # as the service's own user and can read and write what it can: reported as missing
        "unprivileged_user": user is not None,
        "dies_with_worker": bool(pdeathsig_prefix()),
    }
    return Protections(tuple(working), user, active)


def warn_missing_protections(protections: Protections | None = None) -> list[str]:
    protections = protections or probe_protections()
    missing = protections.missing()
    for name in missing:
        warnings.warn(
            f"code sandbox: protection '{name}' is not available on this machine", RuntimeWarning, stacklevel=2
        )
    return missing


class Sandbox:
    def __init__(self, limits: SandboxLimits = SandboxLimits(), protections: Protections | None = None) -> None:
        self.limits = limits
        self.protections = protections or probe_protections()

    def _command(self, result_fd: int, request_fd: int | None = None) -> list[str]:
        fds = [str(result_fd)] + ([] if request_fd is None else [str(request_fd)])
        python = [sys.executable, "-I"] + ([] if self.limits.python_site else ["-S"]) + [str(HARNESS), *fds]
        # the jail dies with the scoring worker that started it, even when that worker is SIGKILLed
        death = list(pdeathsig_prefix())
        flags = list(self.protections.namespaces)
        if not flags:
            return [*death, *python]
        prefix = ["unshare"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user"]
        if "--pid" in flags:
            flags += ["--fork", "--kill-child"]
        return [*death, *prefix, *flags, *python]

    def run(self, program: str, tests: list, mode: str) -> SandboxResult:
        """Run ``program`` against ``tests``: assert statements (mode 'assert') or
        ``{"input", "output"}`` cases (mode 'io'). Never raises for anything the program does."""
        if mode not in ("assert", "io"):
            raise ValueError(f"sandbox mode must be 'assert' or 'io', got {mode!r}")
        if not tests:
            raise ValueError("the program has no tests to run")
        spec, workdir = self.jail_spec(mode)
        limits = self.limits
        spec["program"], spec["tests"] = program, tests
        spec["case_timeout_s"] = max(0.1, limits.wall_s / max(1, len(tests))) if mode == "io" else limits.wall_s
        try:
            return self._execute(spec, len(tests), unavailable_status=EX_TEMPFAIL if mode == "io" else None)
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def jail_spec(self, mode: str) -> tuple[dict, str | None]:
        """The harness's spec for a jail of this sandbox's limits and protections, and the working
        directory made for it (None in a private /tmp); the caller removes that folder."""
        private_tmp = "--mount" in self.protections.namespaces
        workdir = None if private_tmp else tempfile.mkdtemp(prefix="postrl-sandbox-")
        uid, gid = self.protections.unprivileged_user or (None, None)
        if workdir is not None and uid is not None:
            os.chown(workdir, uid, gid)
        limits = self.limits
        spec = {
            "mode": mode,
            "private_tmp": private_tmp,
            "workdir": workdir,
            "tmp_size_mb": limits.tmp_size_mb,
            "uid": uid,
            "gid": gid,
            "output_bytes": limits.output_bytes,
            "limits": {
                "cpu_s": limits.cpu_s,
                "memory_mb": limits.memory_mb,
                "processes": limits.processes,
                "file_size_mb": limits.file_size_mb,
                "open_files": limits.open_files,
            },
        }
        return spec, workdir

    def _execute(self, spec: dict, n_tests: int, unavailable_status: int | None = None) -> SandboxResult:
        """The tests run in a fresh jailed interpreter: its verdicts, its output and why it ended.
        ``unavailable_status``: the harness's exit status for cases it could not start (io mode
        only: there the program runs in a child and cannot choose the harness's status)."""
        result_r, result_w = os.pipe()
        proc = self._spawn(spec, result_w)
        try:
            verdicts, output, error, timed_out = self._read(proc, result_r, n_tests)
        finally:
            kill_group(proc)
            assert proc.stdout is not None
            proc.stdout.close()
            os.close(result_r)
        unavailable = unavailable_status is not None and proc.returncode == unavailable_status
        if unavailable:
            error = (
                "could not start its cases: the sandbox user's process limit stayed reached (another program held it)"
            )
        elif error is None and len(verdicts) < n_tests:
            error = _exit_reason(proc.returncode)
        passed = [verdicts.get(i, (False, None))[0] for i in range(n_tests)]
        errors = [verdicts[i][1] if i in verdicts else (error or "not run") for i in range(n_tests)]
        text = bytes(output[:2000]).decode("utf-8", "replace")
        return SandboxResult(passed, errors, error, timed_out, text, unavailable)

    def _spawn(self, spec: dict, result_w: int) -> subprocess.Popen:
        """The harness process, reading ``spec`` on stdin and writing verdicts to ``result_w``
        (closed here once the child holds it)."""
        with tempfile.TemporaryFile() as spec_file:
            spec_file.write(marshal.dumps(spec))
            spec_file.seek(0)
            try:
                return subprocess.Popen(
                    self._command(result_w),
                    stdin=spec_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=(result_w,),
                    start_new_session=True,
                    env=SCRUBBED_ENV,
                    close_fds=True,
                )
            finally:
                os.close(result_w)

    def _read(
        self, proc: subprocess.Popen, result_r: int, n_tests: int
    ) -> tuple[dict[int, tuple[bool, str | None]], bytearray, str | None, bool]:
        """Its output and verdicts until both streams close, the wall clock runs out or the output
        passes its bound: (verdicts by test, output, error, timed out)."""
        verdicts: dict[int, tuple[bool, str | None]] = {}
        output = bytearray()
        error, timed_out = None, False
        results_buffer = b""
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ, "out")  # type: ignore[arg-type]
        selector.register(result_r, selectors.EVENT_READ, "result")
        deadline = time.monotonic() + self.limits.wall_s + 1.0  # +1 s: interpreter start and jail set-up
        open_streams = 2
        try:
            while open_streams and error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return verdicts, output, f"timed out after {self.limits.wall_s:g}s (wall clock)", True
                for key, _ in selector.select(timeout=left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fd)
                        open_streams -= 1
                    elif key.data == "out":
                        output += chunk
                        if len(output) > self.limits.output_bytes:
                            error = f"output over {self.limits.output_bytes} bytes"
                    else:
                        results_buffer += chunk
                        *lines, results_buffer = results_buffer.split(b"\n")
                        for line in lines:
                            _record_verdict(line, n_tests, verdicts)
        finally:
            selector.close()
        return verdicts, output, error, timed_out


def _record_verdict(line: bytes, n_tests: int, verdicts: dict[int, tuple[bool, str | None]]) -> None:
    """Parse ``index<TAB>1|0<TAB>error``; a line that does not parse is ignored (it counts as no verdict)."""
    parts = line.decode("utf-8", "replace").split("\t", 2)
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in ("0", "1"):
        return
    index = int(parts[0])
    if 0 <= index < n_tests and index not in verdicts:
        verdicts[index] = (parts[1] == "1", parts[2] or None)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "did not finish"
    if code > 128:  # the namespace's init reports a signal N as 128+N
        code = -(code - 128)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)", "SIGKILL": ""}.get(name, "")
        return f"killed by {name}{hint} before all tests ran"
    return f"exited with status {code} before all tests ran"
