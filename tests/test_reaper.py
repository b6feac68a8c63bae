"""The reaper without Ray: a stand-in "raylet" (a child that inherits the driver's mark) starts an
"agent" whose environment has lost the mark, as a process that sets its title can lose it. Both go
when the driver closes cleanly, and when it is killed with SIGKILL; a child of the driver that is
not Ray's survives a clean close and goes with a killed driver."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid

import pytest

pytestmark = pytest.mark.serial  # it looks at every process of the machine

SLEEPER = "import sys, time; time.sleep(600)"


def running(name: str) -> list[str]:
    """Live processes whose last argument is ``name`` (the driver's and the raylet's code mention it too)."""
    out = subprocess.run(["ps", "-ww", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.endswith(f" {name}") and not line.startswith("Z")]


def start_driver(tag: str, clean: bool) -> subprocess.Popen:
    """A driver with a plain child (started before the reaper: not marked), then a reaper, then a
    marked "raylet" whose "agent" runs with an environment that carries no mark; the raylet is gone
    by the time the reaper acts, so nothing marked is above the agent any more."""
    agent = [sys.executable, "-c", SLEEPER, f"agent-{tag}"]
    raylet_code = (  # like Ray's raylet it dies with the driver, and leaves its agent behind
        f"import os, subprocess, time; parent = os.getppid(); subprocess.Popen({agent!r}, env={{}})\n"
        "while os.getppid() == parent: time.sleep(0.05)"
    )
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from postrl.scheduling.reaper import Reaper
        plain = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}, "plain-{tag}"])
        reaper = Reaper()
        raylet = subprocess.Popen([sys.executable, "-c", {raylet_code!r}, "raylet-{tag}"])
        time.sleep(2.0)  # the reaper looks twice a second
        print("started", flush=True)
        if {clean!r} and sys.stdin.readline():  # the test has seen them all running
            raylet.kill()  # as ray.shutdown() does, orphaning the agent that ignores SIGTERM
            raylet.wait()
            reaper.close()
            print("closed", flush=True)
        time.sleep(600)
    """)
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def wait_until_gone(tag: str, kinds: tuple[str, ...], seconds: float = 15.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [line for kind in kinds for line in running(f"{kind}-{tag}")]
        if not left:
            return []
        time.sleep(0.2)
    return left


def test_a_clean_close_takes_rays_processes_even_unmarked_ones_and_spares_the_drivers_own():
    tag = uuid.uuid4().hex
    driver = start_driver(tag, clean=True)
    try:
        assert driver.stdout.readline().strip() == "started"
        assert all(len(running(f"{k}-{tag}")) == 1 for k in ("plain", "raylet", "agent"))
        driver.stdin.write("close\n")
        driver.stdin.flush()
        assert driver.stdout.readline().strip() == "closed"
        assert wait_until_gone(tag, ("raylet", "agent")) == []
        assert len(running(f"plain-{tag}")) == 1  # the driver lives on, and so does its own child
    finally:
        driver.kill()
        driver.wait()
        subprocess.run(["pkill", "-KILL", "-f", tag])


@pytest.mark.parametrize("repeat", range(3))
def test_a_killed_driver_takes_everything_it_started(repeat):
    tag = uuid.uuid4().hex
    driver = start_driver(tag, clean=False)
    try:
        assert driver.stdout.readline().strip() == "started"
        assert all(len(running(f"{k}-{tag}")) == 1 for k in ("plain", "raylet", "agent"))
    finally:
        driver.kill()
        driver.wait()
    try:
        assert wait_until_gone(tag, ("plain", "raylet", "agent")) == []
    finally:
        subprocess.run(["pkill", "-KILL", "-f", tag])
