"""One Controller per run directory: a live holder refuses a second controller (also through the
CLI); a dead holder's lease is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from postrl.run.lease import LEASE_FILE, LeaseHeldError, RunLease

HOLD = "import sys, time; from postrl.run.lease import RunLease; RunLease(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)"


def holder_process(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_live_holder_refuses_a_second_controller_and_a_dead_one_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    proc = holder_process(run_dir)
    try:
        with pytest.raises(LeaseHeldError, match=f"in use by another postrl controller \\(pid {proc.pid} on host"):
            RunLease(run_dir).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    said = []
    lease = RunLease(run_dir)
    lease.acquire(echo=said.append)
    assert said == [
        f"took over {run_dir} from a controller that is no longer running (pid {proc.pid} on host "
        f"{os.uname().nodename})"
    ]
    assert RunLease(run_dir).holder()["pid"] == os.getpid()
    lease.release()
    assert not (run_dir / LEASE_FILE).exists()


def test_stale_heartbeat_of_another_host_is_not_live(tmp_path):
    lease = RunLease(tmp_path, ttl_s=60)
    assert lease.is_live({"host": "elsewhere", "pid": 1, "heartbeat": time.time() - 5})
    assert not lease.is_live({"host": "elsewhere", "pid": 1, "heartbeat": time.time() - 61})


@pytest.mark.slow
def test_cli_refuses_a_second_controller_on_a_run(tmp_path, tiny_model_dir, arithmetic_jsonl):
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        f"name: busy\noutput_dir: {tmp_path}\nmodel: {{path: {tiny_model_dir}}}\n"
        f"data: {{train_files: [{arithmetic_jsonl}]}}\nrollout: {{n: 2, max_tokens: 4}}\n"
    )
    proc = holder_process(run_dir)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "postrl", "train", "--resume", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        proc.kill()
        proc.wait()
    assert done.returncode == 2
    assert f"run directory {run_dir} is in use by another postrl controller (pid {proc.pid}" in done.stderr
