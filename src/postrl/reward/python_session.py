"""A stateful Python interpreter in the code sandbox: one jailed process per episode.

Each cell runs in the same interpreter (variables, imports and functions carry over between
turns), with the sandbox's limits (CPU time for the whole session, memory, processes, files) and
a wall-clock limit per cell. A cell that runs past it kills the whole process group; the next
cell starts a fresh interpreter, and the model is told its state was lost. ``close`` kills the
process group and removes its working directory, so nothing is left behind.
"""

from __future__ import annotations

import marshal
import os
import selectors
import shutil
import subprocess
import tempfile
import time

from postrl.reward.sandbox import SCRUBBED_ENV, Sandbox, SandboxLimits, kill_group


class SessionLost(RuntimeError):
    """The interpreter ran past its limit or exited: it was restarted, its state is gone."""


class PythonSession:
    def __init__(
        self, limits: SandboxLimits = SandboxLimits(cpu_s=60, wall_s=10.0), sandbox: Sandbox | None = None
    ) -> None:
        self.sandbox = sandbox or Sandbox(limits)
        self.limits = self.sandbox.limits
        self.proc: subprocess.Popen | None = None
        self.workdir: str | None = None
        self._requests = self._results = -1

    def _start(self) -> None:
        spec, self.workdir = self.sandbox.jail_spec("session")
        request_r, self._requests = os.pipe()
        self._results, result_w = os.pipe()
        with tempfile.TemporaryFile() as spec_file:
            spec_file.write(marshal.dumps(spec))
            spec_file.seek(0)
            try:
                self.proc = subprocess.Popen(
                    self.sandbox._command(result_w, request_r),
                    stdin=spec_file,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(result_w, request_r),
                    start_new_session=True,
                    env=SCRUBBED_ENV,
                    close_fds=True,
                )
            finally:
                os.close(result_w)
                os.close(request_r)

    def run(self, code: str, timeout_s: float | None = None) -> tuple[str, bool]:
        """The cell's output (printed text, the value of a last expression, or the error) and
        whether it ran without raising; :class:`SessionLost` when it ran past its limit."""
        if self.proc is None:
            self._start()
        data = code.encode("utf-8")
        try:
            os.write(self._requests, b"%d\n" % len(data) + data)
        except BrokenPipeError:
            return self._lost("the interpreter had exited")
        limit = timeout_s if timeout_s is not None else self.limits.wall_s
        reply = self._read_reply(time.monotonic() + limit + 1.0)  # +1 s: the first cell starts the interpreter
        if reply is None:
            return self._lost(f"timed out after {limit:g} s")
        status, output = reply
        return output, status == "ok"

    def _read_reply(self, deadline: float) -> tuple[str, str] | None:
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self._results, selectors.EVENT_READ)
            while True:
                if b"\n" in buffer:
                    header, _, rest = buffer.partition(b"\n")
                    status, _, length = header.decode("ascii", "replace").partition("\t")
                    if not length.isdigit() or status not in ("ok", "error"):
                        return None
                    if len(rest) >= int(length):
                        return status, rest[: int(length)].decode("utf-8", "replace")
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(timeout=left):
                    return None
                chunk = os.read(self._results, 65536)
                if not chunk:
                    return None
                buffer += chunk

    def _lost(self, why: str) -> tuple[str, bool]:
        self.close()
        raise SessionLost(f"{why}; the interpreter was restarted and its variables are gone")

    def close(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None
            for fd in (self._requests, self._results):
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
