"""Every benchmark in smoke mode (tiny sizes, the same code path and JSON keys), so that a change
that breaks one fails here. A benchmark that needs what this machine lacks (TRL, vLLM, a GPU, the
offline SmolLM2) says why and is reported as skipped, never as passed.

The smoke runs go two at a time in the background from the first of these tests on (much of
their time is waiting: time limits and servers starting), longest first; each test then takes its
own run's result. They share one xdist worker (group ``smokes``); ray_scaling, which starts Ray
clusters, runs with the Ray tests (``serial``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_ray import ray_processes

pytestmark = pytest.mark.slow  # benchmark runs and whole CLI sessions: not in the fast tier

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
RAY = ("ray_scaling", ())
RUNS = [(name, ()) for name in SCRIPTS if name != RAY[0]]
RUNS += [("fault_paths", ("--agent",)), ("algorithms", ("--dpo",)), ("distill", ("--demo",))]
_runs: dict[tuple[str, tuple[str, ...]], Future] = {}


def run_smoke(name: str, extra: tuple[str, ...]) -> subprocess.CompletedProcess:
    # one torch thread each: two smoke runs go at once beside the other xdist worker, and more
    # threads than cores made each of them spin (a smoke checks that a script runs, not its speed)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--smoke", "--json", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    if name == "ray_scaling":  # Ray's agents outlive their cluster a little: gone before the next test looks
        deadline = time.monotonic() + 30
        while ray_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
    return done


def smoke(name: str, extra: tuple[str, ...]) -> dict:
    if (name, extra) == RAY:
        done = run_smoke(name, extra)
    else:
        if not _runs:
            pool = ThreadPoolExecutor(2, thread_name_prefix="smoke")
            _runs.update({run: pool.submit(run_smoke, *run) for run in RUNS})
            pool.shutdown(wait=False)
        done = _runs[(name, extra)].result()
    assert done.returncode == 0, f"{name} {extra} --smoke failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(last, dict) and last, done.stdout[-2000:]
    if "skipped" in last:
        assert f"skipped: {last['skipped']}" in done.stdout  # the reason is printed, not only returned
        pytest.skip(f"{name}: {last['skipped']}")
    return last


# with the Ray tests, one after another: one Ray instance of the suite at a time on the machine
CASES = [pytest.param(*RAY, marks=pytest.mark.serial, id=RAY[0])]
CASES += [pytest.param(n, e, marks=pytest.mark.xdist_group("smokes"), id=f"{n}{''.join(e)}") for n, e in RUNS]


@pytest.mark.parametrize(("name", "extra"), CASES)
def test_benchmark_runs_in_smoke_mode(name, extra):
    result = smoke(name, extra)
    if name == "fault_paths" and extra == ("--agent",):  # issue 31's numbers hold even at smoke size
        assert result["faults_tried"] >= 10 and result["faults_handled"] == result["faults_tried"], result["faults"]
        assert result["episodes_lost"] == 0 and result["trained_twice"] == 0
        assert result["hang_episode_s"] <= 2 * result["env_timeout_s"]
        assert result["second_signal_exit_s"] <= 10
    elif name == "distill" and extra == ("--demo",):
        keys = {"teacher_acc", "student_acc_before", "student_acc_after", "reached_fraction", "student_steps"}
        assert keys | {"teacher_steps", "per_seed", "grpo_same_settings_acc"} <= set(result)
        assert result["student_steps"] == max(1, result["teacher_steps"] // 4)
        assert result["student_acc_before"] == 0.315  # the shipped demo model on its 200 held-out problems
    elif name == "fault_paths":
        assert set(result["layouts"]) == {"first", "spread", "last", "one_worker_line"}
        assert result["hang_unscorable"] == 12
    elif name == "ray_scaling":
        assert ray_processes() == [], "the benchmark left Ray processes behind"
        assert result["recovery_lost"] == 0 and result["recovery_duplicated"] == 0
