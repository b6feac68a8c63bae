"""Fault paths a user hits (issues 15 and 31), timed against the limits they must respect.

1. Hanging reward groups: a real `postrl train` step (the demo model, 16 prompts x G=4) whose
   custom reward hangs on every sample of 3 prompts, at reward.timeout_s=5, with the hanging
   groups first in the batch, spread, last, and all in one scoring worker's first line. The
   reward stage must take at most 1.5 x timeout_s in every layout; the worst is reported.
   `--baseline-src DIR` runs the same layouts on another tree's src/ as the peer.
2. An unreachable Ray address: `postrl train CONFIG --ray-address 127.0.0.1:1` (nothing listens)
   and a port that accepts TCP but is not Ray (scheduler.connect_timeout_s=5): seconds until
   the one-line error, against the connect timeout.
3. `--agent`: environment and agent faults (tests/fault_envs.py) each through a real `postrl train`
   step (demo model, 4 prompts x 4 episodes, agent.env_timeout_s=5): the outcome (an episode made
   unscorable while the run goes on, the run stopped with a clear one-line error, or a tool error
   answered to the model and counted), the seconds until the episodes ended or the run stopped,
   episodes lost (not in the step's samples file) or trained twice; and the seconds a second
   SIGTERM takes to end a run whose environment hangs.

    RAY_AUTH_MODE=disabled python benchmarks/fault_paths.py [--json] [--baseline-src DIR] [--agent] [--smoke]
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

from _smoke import add_smoke

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"first": (0, 1, 2), "spread": (2, 7, 11), "last": (13, 14, 15), "one_worker_line": (0, 1, 3)}

REWARD_MODULE = """
import time

def score(prompt, response, answer, hang=False):
    if hang:
        time.sleep(3600)
    return float(answer in response)
"""

STEPS_SCRIPT = textwrap.dedent("""
    import json, sys
    from postrl.config.loading import load_config
    from postrl.run.train_runner import train
    for path in sys.argv[1:]:
        config = load_config(path)
        train(config)
        rows = [json.loads(l) for l in open(config.run_dir / "metrics.jsonl")]
        print(json.dumps({"name": config.name, "reward_s": rows[-1]["time/reward_s"],
                          "step_s": rows[-1]["time/step_s"], "unscorable": rows[-1]["reward/unscorable"]}))
""")


def write_run(folder: Path, name: str, hanging: tuple[int, ...], timeout_s: float) -> Path:
    (folder / "hang_rewards.py").write_text(REWARD_MODULE)
    rows = [{"prompt": f"{10 + p}+{20 + p}=", "answer": str(30 + 2 * p), "hang": p in hanging} for p in range(16)]
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "name": name,
        "output_dir": str(folder / "runs"),
        "steps": 1,
        "prompts_per_step": 16,
        "data": {"train_files": [f"{name}.jsonl"], "shuffle": False},
        "rollout": {"n": 4, "max_tokens": 8},
        "reward": {
            "components": [{"type": "custom", "name": "h", "function": "hang_rewards:score"}],
            "timeout_s": timeout_s,
            "max_failure_rate": 1.0,
        },
        "train": {"mini_batch_size": 64, "micro_batch_size": 64},
        "checkpoint": {"every_steps": 0},
        "logging": {"trackers": ["jsonl"], "console": False},
    }
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(config))
    return path


def hanging_layouts(src: str | None, timeout_s: float) -> dict[str, dict[str, float]]:
    """Each layout's reward stage, one `postrl train` step each, all in one process."""
    with tempfile.TemporaryDirectory() as tmp:
        configs = [str(write_run(Path(tmp), name, hanging, timeout_s)) for name, hanging in LAYOUTS.items()]
        env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
        out = subprocess.run(
            [sys.executable, "-c", STEPS_SCRIPT, *configs], capture_output=True, text=True, cwd=tmp, env=env, timeout=900
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {row.pop("name"): row for row in rows}


def time_to_error(args: list[str], cwd: str) -> tuple[float, str]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "postrl.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    elapsed = time.monotonic() - start
    line = next((x for x in out.stderr.splitlines() if x.startswith("postrl train: error:")), out.stderr[-300:])
    return elapsed, line


def unreachable(timeout_s: float) -> dict[str, float | str]:
    with tempfile.TemporaryDirectory() as tmp:
        config = str(write_run(Path(tmp), "ray", (), timeout_s))
        refused_s, refused = time_to_error(["train", config, "--ray-address", "127.0.0.1:1"], tmp)
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(16)
            address = f"127.0.0.1:{server.getsockname()[1]}"
            silent_s, silent = time_to_error(
                ["train", config, "--ray-address", address, f"scheduler.connect_timeout_s={timeout_s:g}"], tmp
            )
    return {
        "refused_s": round(refused_s, 2),
        "refused_error": refused,
        "not_ray_s": round(silent_s, 2),
        "not_ray_error": silent,
    }


def reward_faults(args: argparse.Namespace, timeout_s: float) -> dict:
    layouts = hanging_layouts(None, timeout_s)
    worst = max(layouts, key=lambda name: layouts[name]["reward_s"])
    result: dict = {
        "timeout_s": timeout_s,
        "layouts": {name: {k: round(v, 2) for k, v in row.items()} for name, row in layouts.items()},
        "hang_reward_s": round(layouts[worst]["reward_s"], 2),
        "hang_reward_over_timeout": round(layouts[worst]["reward_s"] / timeout_s, 2),
        "hang_worst_layout": worst,
        "hang_unscorable": layouts[worst]["unscorable"],
    }
    if args.baseline_src:
        base = hanging_layouts(args.baseline_src, timeout_s)
        result["baseline_layouts_reward_s"] = {name: round(row["reward_s"], 2) for name, row in base.items()}
        result["baseline_hang_reward_s"] = round(max(row["reward_s"] for row in base.values()), 2)
    result.update(unreachable(timeout_s))
    print(f"3 of 16 groups' rewards hang, reward.timeout_s={timeout_s:g}: reward stage by layout")
    print(f"{'layout':<18}{'hanging groups':>16}{'reward s':>10}{'/ timeout':>11}{'unscorable':>12}")
    for name, row in layouts.items():
        print(f"{name:<18}{str(LAYOUTS[name]):>16}{row['reward_s']:>10.2f}{row['reward_s'] / timeout_s:>11.2f}"
              f"{row['unscorable']:>12.0f}")  # fmt: skip
    for name, value in result.get("baseline_layouts_reward_s", {}).items():
        print(f"  baseline {name}: {value} s")
    print(f"worst: {worst}, {result['hang_reward_over_timeout']} x timeout_s (target <= 1.5)")
    print(f"--ray-address 127.0.0.1:1 -> error in {result['refused_s']} s: {result['refused_error']}")
    print(
        f"not-Ray port, connect_timeout_s={timeout_s:g} -> error in {result['not_ray_s']} s: {result['not_ray_error']}"
    )
    return result


# -- agent faults ---------------------------------------------------------------------------------
AGENT_FAULTS = {  # name: (overrides, expected outcome)
    "reset raises": (["agent.env=tests.fault_envs:ResetRaises"], "run_stopped_clearly"),
    "step raises": (["agent.env=tests.fault_envs:StepRaises"], "run_stopped_clearly"),
    "step returns a bad type": (["agent.env=tests.fault_envs:StepReturnsStr"], "run_stopped_clearly"),
    "malformed message": (["agent.env=tests.fault_envs:MalformedMessage"], "run_stopped_clearly"),
    "non-numeric reward": (["agent.env=tests.fault_envs:NonNumericReward"], "run_stopped_clearly"),
    "step hangs (1 prompt in 4)": (["agent.env=tests.fault_envs:SomeStepsHang"], "episode_unscorable"),
    "tool hangs": (
        ["agent.env=tests.fault_envs:ToolCaller", "agent.env_options={tool: slow_lookup, arguments: {key: x}}",
         "agent.tools_in_prompt=none"],
        "run_stopped_clearly",
    ),
    "tool gets wrongly typed arguments": (
        ["agent.env=tests.fault_envs:ToolCaller", "agent.tools_in_prompt=none"], "tool_error_counted"
    ),
    "agent function raises": (["agent.env=null", "agent.function=tests.fault_envs:agent_raises"], "run_stopped_clearly"),
    "serve-env reset fails": (["agent.env={serve_env}"], "run_stopped_clearly"),
}  # fmt: skip

FAULTS_SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from postrl.cli import main
    for args in json.loads(sys.argv[1]):
        err = io.StringIO()
        began = time.monotonic()
        with contextlib.redirect_stderr(err):
            code = main(args)
        print(json.dumps({"code": code, "seconds": time.monotonic() - began, "stderr": err.getvalue()}), flush=True)
""")


def limits(overrides: list[str], timeout_s: float) -> list[str]:
    """The time and turn limits the fault's kind of run reads (an agent function: its whole episode's)."""
    if any(o.startswith("agent.function=") for o in overrides):
        return [f"agent.function_timeout_s={10 * timeout_s}"]
    return ["agent.max_tokens_per_turn=8", f"agent.env_timeout_s={timeout_s}"]


def agent_config(folder: Path, timeout_s: float) -> Path:
    rows = [{"prompt": f"{i}+1=", "secret": 0 if i == 0 else i + 1} for i in range(4)]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "model": {"path": "demo"},
        "steps": 1,
        "prompts_per_step": 4,
        "data": {"train_files": [str(folder / "rows.jsonl")], "shuffle": False},
        "rollout": {"n": 4, "max_tokens": 8},
        "agent": {"env": "tests.fault_envs:GuessNumber", "max_context": 100},
        "train": {"mini_batch_size": 16, "micro_batch_size": 16},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress_bar": False, "trackers": ["jsonl"], "samples_first_steps": 1},
    }  # fmt: skip
    path = folder / "agent.yaml"
    path.write_text(json.dumps(config))
    return path


def judge(name: str, expected: str, run: Path, reply: dict, episodes: int) -> dict:
    """The fault's outcome, read from the run directory and the command's error."""
    err = reply["stderr"]
    unscored = run / "unscored_step_1.jsonl"
    samples = unscored if unscored.exists() else run / "samples" / "step_1.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()] if samples.exists() else []
    seen = sum(r["episode"] is not None and r["episode"]["part"] == 0 for r in rows)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if (
        run / "metrics.jsonl").exists() else []  # fmt: skip
    steps = [m["step"] for m in metrics]
    failed = [r for r in rows if r["unscorable"]]
    if reply["code"] == 2 and "could not be scored" in err and "Traceback" not in err:
        outcome = "run_stopped_clearly"
    elif reply["code"] == 0 and failed:
        outcome = "episode_unscorable"
    elif reply["code"] == 0 and metrics and metrics[-1].get("agent/tool_errors", 0) >= episodes:
        outcome = "tool_error_counted"
    else:
        outcome = f"unexpected (exit {reply['code']})"
    ended = max((r["episode"]["env_s"] for r in failed if r["episode"]), default=None)
    reason = next((line for line in err.splitlines() if "error:" in line), "")
    if not reason and failed:  # the run went on: what its samples file says of the failed episodes
        reason = f"run finished; {len(failed)}/{len(rows)} episodes unscorable: {failed[0]['error']}"
    elif not reason and metrics:
        reason = f"run finished; agent/tool_errors {metrics[-1].get('agent/tool_errors', 0):g} of {episodes} episodes"
    return {
        "fault": name,
        "outcome": outcome,
        "expected": expected,
        "handled": outcome == expected,
        "seconds": round(reply["seconds"], 2),
        "episode_s": None if ended is None else round(ended, 2),
        "episodes_lost": episodes - seen,
        "trained_twice": len(steps) - len(set(steps)),
        "reason": reason[:300],
    }


def second_signal(folder: Path, config: Path) -> float:
    """Seconds from a second SIGTERM to the end of a run whose environment step hangs."""
    args = ["train", str(config), "agent.env=tests.fault_envs:StepHangs", "agent.env_timeout_s=600",
            f"output_dir={folder / 'signal'}", "name=signal"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "postrl.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    from tests.fault_envs import sigterm_twice

    took, err = sigterm_twice(proc, folder / "signal" / "signal" / "config.yaml")
    if "Traceback" in err:
        print(f"second signal: a traceback was printed:\n{err[-2000:]}", file=sys.stderr)
        return float("inf")
    return took


def agent_faults(timeout_s: float) -> dict:
    os.chdir(ROOT)  # tests.fault_envs imports from the repository's root
    sys.path.insert(0, str(ROOT))
    from tests.test_reward_server import start_cli_server, stop_server

    episodes = 16
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = agent_config(folder, timeout_s)
        server, url = start_cli_server(["serve-env", "tests.fault_envs:ResetRaises"])
        try:
            runs = [["train", str(config), f"output_dir={folder / 'runs'}", f"name=fault{i}",
                     *[o.replace("{serve_env}", url) for o in overrides], *limits(overrides, timeout_s)]
                    for i, (overrides, _) in enumerate(AGENT_FAULTS.values())]  # fmt: skip
            out = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, json.dumps(runs)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=1800)  # fmt: skip
        finally:
            stop_server(server)
        replies = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"code"')]
        if len(replies) != len(AGENT_FAULTS):
            raise RuntimeError(f"the fault runs stopped early:\n{out.stderr[-3000:]}")
        table = [
            judge(name, expected, folder / "runs" / f"fault{i}", reply, episodes)
            for i, ((name, (_, expected)), reply) in enumerate(zip(AGENT_FAULTS.items(), replies))
        ]
        exit_s = second_signal(folder, config)
    hangs = [row["episode_s"] for row in table if "hang" in row["fault"] and row["episode_s"] is not None]
    result = {
        "env_timeout_s": timeout_s,
        "faults_tried": len(table),
        "faults_handled": sum(row["handled"] for row in table),
        "episodes_lost": sum(row["episodes_lost"] for row in table),
        "trained_twice": sum(row["trained_twice"] for row in table),
        "hang_episode_s": max(hangs) if hangs else None,
        "second_signal_exit_s": round(exit_s, 2),
        "faults": table,
    }
    print(f"\nagent faults: demo model, 4 prompts x 4 episodes, agent.env_timeout_s={timeout_s:g}")
    print(f"{'fault':<36}{'outcome':<22}{'ok':>4}{'run s':>8}{'episode s':>11}{'lost':>6}{'twice':>7}")
    for row in table:
        episode_s = "-" if row["episode_s"] is None else f"{row['episode_s']:.2f}"
        print(f"{row['fault']:<36}{row['outcome']:<22}{'yes' if row['handled'] else 'NO':>4}{row['seconds']:>8.2f}"
              f"{episode_s:>11}{row['episodes_lost']:>6}{row['trained_twice']:>7}")  # fmt: skip
    for row in table:
        print(f"  {row['fault']}: {row['reason']}")
    print(f"faults handled {result['faults_handled']}/{result['faults_tried']}, episodes lost {result['episodes_lost']}, "
          f"hang ends its episode in {result['hang_episode_s']} s (<= {2 * timeout_s:g}), "
          f"a second SIGTERM ends the run in {result['second_signal_exit_s']} s (<= 10)")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline-src", help="the src/ folder of the commit to compare the hanging step with")
    parser.add_argument("--agent", action="store_true", help="environment and agent faults through postrl train")
    add_smoke(parser)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    timeout_s = 1.0 if args.smoke else 5.0
    result = agent_faults(timeout_s) if args.agent else reward_faults(args, timeout_s)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
