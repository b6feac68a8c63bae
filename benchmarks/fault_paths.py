"""Fault paths a user hits on day two (issue 15), timed against the limits they must respect.

1. Hanging reward groups: a real `postrl train` step (the demo model, 16 prompts x G=4) whose
   custom reward hangs on every sample of 3 prompts, at reward.timeout_s=5. The step's reward
   stage must take at most 2 x timeout_s (it took a timeout per queued sample before: ~20-30 s).
   The same workload on the previous commit's pool is the peer (`--baseline-src DIR` points at
   its src/; without it the peer is not run).
2. An unreachable Ray address: `postrl train CONFIG --ray-address 127.0.0.1:1` (nothing listens)
   and a port that accepts TCP but is not Ray (scheduler.connect_timeout_s=5): seconds until
   the one-line error, against the connect timeout.

    RAY_AUTH_MODE=disabled python benchmarks/fault_paths.py [--json] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TIMEOUT_S = 5.0
HANGING = (2, 7, 11)

REWARD_MODULE = """
import time

def score(prompt, response, answer, hang=False):
    if hang:
        time.sleep(3600)
    return float(answer in response)
"""

STEP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from postrl.config.loading import load_config
    from postrl.run.train_runner import train
    config = load_config(sys.argv[1])
    train(config)
    rows = [json.loads(l) for l in open(config.run_dir / "metrics.jsonl")]
    print(json.dumps({"reward_s": rows[-1]["time/reward_s"], "step_s": rows[-1]["time/step_s"],
                      "unscorable": rows[-1]["reward/unscorable"]}))
""")


def write_run(folder: Path) -> Path:
    (folder / "hang_rewards.py").write_text(REWARD_MODULE)
    rows = [{"prompt": f"{10 + p}+{20 + p}=", "answer": str(30 + 2 * p), "hang": p in HANGING} for p in range(16)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "name": "hang",
        "output_dir": str(folder / "runs"),
        "steps": 1,
        "prompts_per_step": 16,
        "data": {"train_files": ["data.jsonl"], "shuffle": False},
        "rollout": {"n": 4, "max_tokens": 8},
        "reward": {
            "components": [{"type": "custom", "name": "h", "function": "hang_rewards:score"}],
            "timeout_s": TIMEOUT_S,
            "max_failure_rate": 1.0,
        },
        "train": {"mini_batch_size": 64, "micro_batch_size": 64},
        "checkpoint": {"every_steps": 0},
        "logging": {"tensorboard": False, "console": False},
    }
    path = folder / "hang.yaml"
    path.write_text(json.dumps(config))
    return path


def hanging_step(src: str | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        config = write_run(Path(tmp))
        env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
        out = subprocess.run(
            [sys.executable, "-c", STEP_SCRIPT, str(config)],
            capture_output=True,
            text=True,
            cwd=tmp,
            env=env,
            timeout=600,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])


def time_to_error(args: list[str], cwd: str) -> tuple[float, str]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "postrl.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    elapsed = time.monotonic() - start
    line = next((x for x in out.stderr.splitlines() if x.startswith("postrl train: error:")), out.stderr[-300:])
    return elapsed, line


def unreachable() -> dict[str, float | str]:
    with tempfile.TemporaryDirectory() as tmp:
        config = str(write_run(Path(tmp)))
        refused_s, refused = time_to_error(["train", config, "--ray-address", "127.0.0.1:1"], tmp)
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(16)
            address = f"127.0.0.1:{server.getsockname()[1]}"
            silent_s, silent = time_to_error(
                ["train", config, "--ray-address", address, f"scheduler.connect_timeout_s={TIMEOUT_S:g}"], tmp
            )
    return {
        "refused_s": round(refused_s, 2),
        "refused_error": refused,
        "not_ray_s": round(silent_s, 2),
        "not_ray_error": silent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline-src", help="the src/ folder of the commit to compare the hanging step with")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    step = hanging_step(None)
    result: dict[str, float | str] = {
        "hang_reward_s": round(step["reward_s"], 2),
        "hang_step_s": round(step["step_s"], 2),
        "hang_reward_over_timeout": round(step["reward_s"] / TIMEOUT_S, 2),
        "hang_unscorable": step["unscorable"],
    }
    if args.baseline_src:
        base = hanging_step(args.baseline_src)
        result["baseline_hang_reward_s"] = round(base["reward_s"], 2)
        result["speedup_vs_baseline"] = round(base["reward_s"] / step["reward_s"], 2)
    result.update(unreachable())
    rows = [
        ("reward stage, 3 of 16 groups hanging (s)", result["hang_reward_s"], f"<= {2 * TIMEOUT_S:g}"),
        ("  / timeout_s", result["hang_reward_over_timeout"], "<= 2"),
        ("whole step (s)", result["hang_step_s"], ""),
        ("unscorable samples", result["hang_unscorable"], "12"),
    ]
    if "baseline_hang_reward_s" in result:
        rows += [
            ("previous pool, reward stage (s)", result["baseline_hang_reward_s"], ""),
            ("  speed-up", result["speedup_vs_baseline"], ""),
        ]
    rows += [
        ("--ray-address 127.0.0.1:1 -> error (s)", result["refused_s"], "bounded"),
        (
            f"not-Ray port, connect_timeout_s={TIMEOUT_S:g} -> error (s)",
            result["not_ray_s"],
            f"~{TIMEOUT_S:g} + start-up",
        ),
    ]
    print(f"{'measure':52s} {'value':>10s}  target")
    for name, value, target in rows:
        print(f"{name:52s} {value!s:>10s}  {target}")
    print(f"  {result['refused_error']}\n  {result['not_ray_error']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
