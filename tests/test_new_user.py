"""Issue 8: what a new user does on the first day, end to end, in a fresh folder: their own data and
reward module next to a config, a short run of the demo model, `postrl eval` on their own held-out
file, the trained model served and called with the official `openai` client, and the same command
run again (refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from openai import OpenAI

from tests.test_serve import free_port

pytestmark = pytest.mark.slow  # Ray clusters, benchmark runs, whole CLI sessions: not in the fast tier


def postrl(*args: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "postrl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_first_day(tmp_path):
    work = tmp_path / "my_project"
    work.mkdir()
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(100, 140, 3) for b in range(200, 240, 7)]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "heldout.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(300, 310))
    )
    (work / "my_rewards.py").write_text(
        textwrap.dedent("""
        import re

        def exact(prompt, response, answer, **columns):
            got = re.search(r"<answer>(.*?)</answer>", response)
            print("checking", prompt, "->", response)
            if got is None:
                return 0.0, "no <answer> tags"
            return float(got.group(1).strip() == answer), f"answered {got.group(1)!r}, wanted {answer!r}"
    """)
    )
    (work / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "first",
                "steps": 3,
                "prompts_per_step": 8,
                "model": {"path": "demo"},
                "data": {"train_files": ["train.jsonl"]},
                "rollout": {"n": 4, "max_tokens": 16},
                "reward": {
                    "components": [
                        {"name": "exact", "type": "custom", "function": "my_rewards:exact", "accuracy": True}
                    ],
                    "num_workers": 1,
                },
                "train": {"lr": 1e-4, "mini_batch_size": 32, "micro_batch_size": 16},
                "checkpoint": {"every_steps": 2},
            }
        )
    )

    done = postrl("train", "config.yaml", cwd=work)
    assert done.returncode == 0, done.stderr
    assert "step 3/3 | reward" in done.stdout and "\r" not in done.stdout + done.stderr
    run = work / "runs" / "first"
    assert (run / "final_model" / "model.safetensors").is_file() and (run / "reward_accuracy.png").is_file()
    assert "checking" in (run / "reward_workers.log").read_text()
    sample = json.loads((run / "samples" / "step_1.jsonl").read_text().splitlines()[0])
    assert sample["reasons"]["exact"].startswith(("answered", "no <answer>"))

    done = postrl("eval", "--run", "runs/first", "--data", "heldout.jsonl", cwd=work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("heldout.jsonl: accuracy ") and "(" in done.stdout and "/10)" in done.stdout

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "postrl.cli",
            "serve-rollout",
            "--model",
            "runs/first/final_model",
            "--port",
            str(port),
            "--served-model-name",
            "first",
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = server.stdout.readline()
        assert f"serving first (NativeRolloutWorker, context 128) at http://127.0.0.1:{port}/v1" in banner, (
            banner + server.stderr.read()
        )
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model="first", prompt="123+456=", max_tokens=16, temperature=0.0, logprobs=2, stream=True
        )
        chunks = [c for c in stream if c.choices]
        streamed = "".join(c.choices[0].text for c in chunks)
        whole = client.completions.create(model="first", prompt="123+456=", max_tokens=16, temperature=0.0, logprobs=2)
        assert streamed == whole.choices[0].text and streamed.startswith("<answer>")
        assert all(len(top) == 2 for top in whole.choices[0].logprobs.top_logprobs)
        assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == whole.choices[0].logprobs.tokens
    finally:
        server.terminate()
        server.wait(timeout=30)

    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    time.sleep(0.01)
    again = postrl("train", "config.yaml", cwd=work)
    assert again.returncode == 2
    assert "run directory runs/first already holds a run" in again.stderr and "--resume runs/first" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
