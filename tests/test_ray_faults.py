"""Ray paths a new user hits on day two, on a real local Ray cluster: a 2-rank FSDP2 group under
Ray (it deadlocked), an unreachable cluster address (it hung), a driver killed with SIGKILL (its
Ray processes lived on), and a placement that cannot succeed (it waited, then blamed num_cpus)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"
ray = pytest.importorskip("ray")

from postrl.config.loading import build_config  # noqa: E402
from postrl.run.train_runner import train  # noqa: E402
from postrl.scheduling.ray_scheduler import RayScheduler  # noqa: E402
from postrl.workers.handles import PlacementError  # noqa: E402
from tests.test_ray import ray_config, ray_processes  # noqa: E402

# Ray clusters, benchmark runs, whole CLI sessions: not in the fast tier; one xdist worker runs them all
pytestmark = [pytest.mark.slow, pytest.mark.serial]

POSTRL = [sys.executable, "-m", "postrl.cli"]


def test_two_fsdp_ranks_under_ray_train_two_steps(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    config = build_config(
        {
            **config.model_dump(mode="json"),
            "steps": 2,
            "scheduler": {
                "type": "ray",
                "rollout": {"workers": 1, "threads": 1},
                "train": {"workers": 2, "threads": 1},
            },
        }
    )
    start = time.monotonic()
    controller = train(config).controller
    assert time.monotonic() - start < 120  # it used to wait out a 300 s start-up timeout and fail
    assert controller.step_count == 2
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
    assert (config.run_dir / "final_model" / "model.safetensors").is_file()
    assert not ray.is_initialized() and ray_processes() == []


def _write_config(tmp_path, model_dir, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(
        json.dumps(
            {
                "name": "r",
                "output_dir": str(tmp_path / "runs"),
                "steps": 1,
                "prompts_per_step": 2,
                "model": {"path": str(model_dir)},
                "data": {"train_files": [str(data)]},
                "rollout": {"n": 2, "max_tokens": 4, "device": "cpu"},
                "train": {"device": "cpu"},
                "reward": {"components": [{"type": "math", "name": "acc"}]},
                "logging": {"trackers": ["jsonl"]},
            }
        )
    )
    return str(path)


def test_an_unreachable_cluster_address_fails_fast_naming_it(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = _write_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    start = time.monotonic()
    out = subprocess.run(
        [*POSTRL, "train", config, "--ray-address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("postrl train: error:")]
    assert errors == [
        "postrl train: error: cannot reach the Ray cluster at 127.0.0.1:1 "
        "(scheduler.address=127.0.0.1:1): Connection refused"
    ], out.stderr[-2000:]
    assert elapsed < 30, elapsed
    assert not (tmp_path / "runs" / "r").exists()  # nothing was written


def test_a_port_that_is_not_ray_fails_within_the_connect_timeout(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = _write_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    with socket.socket() as server:  # accepts TCP connections and never speaks Ray's protocol
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        start = time.monotonic()
        out = subprocess.run(
            [*POSTRL, "train", config, "--ray-address", address, "scheduler.connect_timeout_s=3"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        f"postrl train: error: could not connect to the Ray cluster at {address} (scheduler.address={address}) "
        "within 3 s (scheduler.connect_timeout_s)"
    ) in out.stderr, out.stderr[-2000:]
    assert elapsed < 25, elapsed


def test_a_killed_driver_leaves_no_ray_process(tmp_path, tiny_model_dir, arithmetic_jsonl):
    assert ray_processes() == []
    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    (tmp_path / "config.json").write_text(config.model_dump_json())
    script = textwrap.dedent(f"""
        import os, sys, time
        os.environ["RAY_AUTH_MODE"] = "disabled"
        sys.path.insert(0, {os.getcwd()!r})
        from postrl.config.run import RunConfig
        from postrl.scheduling.ray_scheduler import RayScheduler
        config = RunConfig.model_validate_json(open({str(tmp_path / "config.json")!r}).read())
        scheduler = RayScheduler(config.scheduler, config.import_paths)
        print("placed", flush=True)
        time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "placed"
        assert any("raylet" in p for p in ray_processes())
        deadline = time.monotonic() + 20
        while not any("DashboardAgent" in p for p in ray_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)  # the agents the raylet starts are the ones that outlived the driver
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 20
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes() == []


def test_a_placement_that_cannot_succeed_names_the_short_resource(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl, train={"workers": 1, "num_gpus": 1})
    start = time.monotonic()
    with pytest.raises(PlacementError) as err:
        RayScheduler(config.scheduler, config.import_paths)
    assert time.monotonic() - start < 60
    assert "the train workers cannot be placed: short of GPU: asked 1, the cluster has 0 (0 free)" in str(err.value)
    assert not ray.is_initialized()


def test_sft_runs_its_train_ranks_as_ray_actors(tmp_path, tiny_model_dir):
    from postrl.config.loading import load_config
    from postrl.config.sft import SFTRunConfig
    from postrl.run.metrics import read_metrics
    from postrl.run.sft_runner import train_sft

    rows = [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 18)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft.yaml").write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "runs"),
                "model": {"path": str(tiny_model_dir)},
                "data": {"train_files": ["d.jsonl"]},
                "logging": {"trackers": ["jsonl"]},
                "train": {"mini_batch_size": 4, "micro_batch_size": 2, "device": "cpu"},
                "scheduler": {"type": "ray", "train": {"workers": 2, "threads": 1}},
            }
        )
    )
    config = load_config(tmp_path / "sft.yaml", model=SFTRunConfig)
    assert train_sft(config) == 2
    assert [r["step"] for r in read_metrics(config.run_dir / "metrics.jsonl")] == [1, 2]
    assert (config.run_dir / "final_model" / "model.safetensors").is_file()
    assert not ray.is_initialized() and ray_processes() == []
