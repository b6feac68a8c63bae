"""``agent.env: openenv:module:app``: an OpenEnv environment server that postrl starts itself.

The app (``create_app(...)`` of ``openenv-core``, the object ``uvicorn module:app`` serves) runs in
a process of its own, ``python -m uvicorn module:app`` on a free loopback port, started before the
run's first episode and stopped with the run; its episodes then go through OpenEnv's own client as
a server reached by URL does (:mod:`postrl.rollout.agentic.openenv_env`). The process runs under
``setpriv --pdeathsig KILL`` where it can, so a trainer killed outright takes it along.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from postrl.workers.net import free_port
from postrl.workers.process import pdeathsig_prefix


class OpenEnvServerError(RuntimeError):
    """The server did not start: its module failed, it exited, or it did not answer in time."""


def local_app(spec: str) -> str | None:
    """The ``module:app`` of an ``openenv:`` spec that names one (None: a URL, or not OpenEnv)."""
    target = spec.removeprefix("openenv:") if spec.startswith("openenv:") else None
    return None if target is None or target.startswith(("http://", "https://")) else target


class LocalOpenEnvServer:
    """An OpenEnv app served in a process of its own, on loopback, until :meth:`close`."""

    def __init__(self, app: str, start_timeout_s: float = 60.0) -> None:
        module, _, attr = app.partition(":")
        if not module or not attr:
            raise OpenEnvServerError(
                f"agent.env: openenv:{app}: give the server's URL (openenv:http://host:port) or its app "
                "(openenv:module:app, served by postrl)"
            )
        self.app = app
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        paths = [p for p in sys.path if p] + [os.getcwd()]  # the run's import paths reach the app's module
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
        self.process = subprocess.Popen(
            [*pdeathsig_prefix(), *command, "--log-level", "warning"],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            self._wait(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise OpenEnvServerError(
                    f"agent.env: openenv:{self.app}: the server exited ({self.process.returncode}) before it answered: "
                    f"{self._last_lines()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise OpenEnvServerError(
            f"agent.env: openenv:{self.app}: the server did not answer at {self.url}/health within {timeout_s:g} s"
        )

    def _last_lines(self, count: int = 3) -> str:
        self.log.seek(0)
        lines = [line for line in self.log.read().decode(errors="replace").splitlines() if line.strip()]
        return " | ".join(lines[-count:]) or "(no output)"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
