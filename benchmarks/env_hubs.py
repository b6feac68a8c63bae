"""The tools and environments users already have, measured: MCP servers as tool sources and a
verifiers environment trained on unmodified.

mcp  overhead: the same calculator called 300 times through an MCP stdio server
     (examples/agents/mcp_calculator.py, FastMCP, through the official client) and in-process
     (postrl's ToolBox), in alternating blocks; the overhead is the difference of the medians.
     learning: examples/agents/mcp_tools.yaml (the shipped agentic-demo warm start, GRPO on products,
     its calculator served over MCP): held-out success (greedy, 100 problems never trained on) before
     and after --steps steps; the MCP tool calls per training episode and the share of episodes
     that call it (from the run's samples files); the server processes left after the run (0).

verifiers  examples/verifiers/arith_tools.py (a verifiers ToolEnv and its rubric) with SmolLM2-135M-
     Instruct's shipped tool-calling warm start, tasks chosen by the RULE in _verifiers_learning.py;
     held-out success on the environment's eval split before and after --minutes of GRPO through
     agent.verifiers; retokenization mismatches (0) and rubric_equal (postrl's reward is verifiers'
     own scoring of the same completion). Skipped, saying why, where SmolLM2 is not installed.

openenv  examples/openenv/guess_server.py (a digit-guessing game written against openenv-core's server
     API) served by postrl itself (agent.env: openenv:guess_server:app), played by the demo model
     through OpenEnv's own client, 16 episodes at a time (max_concurrent_episodes: the server's
     max_concurrent_envs): 64 games x 4 episodes of up to 3 turns (the demo model's turns run to the
     8-token limit, which ends an episode after one turn); episodes, the unscorable
     ones (0 for a healthy server), episodes per minute, server processes left after the run (0).

    python benchmarks/env_hubs.py [--part mcp|verifiers|openenv] [--steps 80] [--minutes 45] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from _smoke import add_smoke

from postrl.models.loading import AGENTIC_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "agents" / "mcp_tools.yaml"
SERVER = ROOT / "examples" / "agents" / "mcp_calculator.py"


def server_processes() -> list[int]:
    """Live processes running the example's MCP server."""
    return processes_with(str(SERVER))


def overhead(calls: int, blocks: int = 6) -> dict:
    from postrl.config.agent import McpServer
    from postrl.rollout.agentic.builtin_tools import calculator
    from postrl.rollout.agentic.mcp_tools import McpTools
    from postrl.rollout.agentic.tools import ParsedCall, Tool, ToolBox

    tools = McpTools([McpServer(name="calculator", command=["python", str(SERVER)])])
    episode = tools.episode()
    box = ToolBox([Tool.from_function(calculator)])
    per_block = max(1, calls // blocks)
    times: dict[str, list[float]] = {"mcp": [], "in_process": []}
    try:
        for block in range(blocks):
            for kind in ("mcp", "in_process") if block % 2 == 0 else ("in_process", "mcp"):
                for i in range(per_block):
                    expression = f"{123 + i} * {45 + block}"
                    began = time.perf_counter()
                    if kind == "mcp":
                        text, record = episode.call("calculator", {"expression": expression})
                    else:
                        text, record = box.call(ParsedCall("calculator", {"expression": expression}))
                    times[kind].append(time.perf_counter() - began)
                    assert record.error is None and text == str((123 + i) * (45 + block)), (kind, text)
    finally:
        box.close()
        episode.close()
        tools.close()
    mcp_ms, local_ms = (1000 * statistics.median(times[k]) for k in ("mcp", "in_process"))
    return {
        "calls": len(times["mcp"]),
        "mcp_ms_per_call": round(mcp_ms, 3),
        "in_process_ms_per_call": round(local_ms, 3),
        "overhead_ms_per_call": round(mcp_ms - local_ms, 3),
    }


def tool_use(run_dir: Path) -> dict:
    """The training episodes' MCP tool calls, from the run's samples files."""
    episodes = calls = calling = 0
    for path in sorted((run_dir / "samples").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            episode = json.loads(line).get("episode")
            if episode is None:
                continue
            episodes += 1
            calls += episode["tool_calls"]
            calling += episode["tool_calls"] > 0
    return {
        "episodes": episodes,
        "tool_calls": calls,
        "calls_per_episode": round(calls / max(1, episodes), 3),
        "episodes_calling_share": round(calling / max(1, episodes), 3),
    }


def learning(steps: int, seed: int, smoke: bool) -> dict:
    from postrl.config.loading import build_config
    from postrl.controller.env_episodes import EnvEpisodes
    from postrl.data.prompt_source import prompt_source
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.run.resolve import resolved_run
    from postrl.run.train_runner import train
    from postrl.run.validation import Validator, load_validation_set

    out = Path(tempfile.mkdtemp(prefix="env-hubs-"))
    data = yaml.safe_load(EXAMPLE.read_text())
    data["agent"]["mcp_servers"][0]["command"] = ["python", str(SERVER)]  # wherever this runs from
    overrides = [f"model.path={AGENTIC_MODEL_DIR}", f"output_dir={out}", f"steps={steps}", f"seed={seed}"]
    overrides += ["logging.samples_every=1", "checkpoint.every_steps=0"]  # every step's episodes, on disk
    if smoke:
        overrides += ["prompts_per_step=2", "rollout.n=2", "data.val_size=4", "train.mini_batch_size=4"]
        overrides += ["train.micro_batch_size=4", "logging.eval_every=0"]
    config = resolved_run(build_config(data, overrides))
    tokenizer = load_tokenizer(str(AGENTIC_MODEL_DIR))
    validator = Validator(config, load_validation_set(config, prompt_source(config.data, tokenizer)))

    def held_out(path: str) -> dict[str, float]:
        engine = NativeRolloutWorker.from_hf(load_causal_lm(path), tokenizer, torch.float32)
        episodes = EnvEpisodes(config.agent, tokenizer, engine, None)  # type: ignore[arg-type] # the env scores
        try:
            return validator.run(episodes, None)
        finally:
            episodes.close()

    before = held_out(str(AGENTIC_MODEL_DIR))
    began = time.perf_counter()
    train(config, overwrite=True)
    wall = time.perf_counter() - began
    after = held_out(str(config.run_dir / "final_model"))
    left = server_processes()
    return {
        "success_before": before["val/accuracy"],
        "success_after": after["val/accuracy"],
        "held_out": config.data.val_size,
        "steps": steps,
        "minutes": round(wall / 60, 2),
        **tool_use(config.run_dir),
        "held_out_tool_calls_after": after.get("val/agent/tool_calls"),  # over all its episodes
        "processes_left": len(left),
    }


def mcp_part(args: argparse.Namespace) -> dict:
    try:
        import mcp  # noqa: F401
    except ImportError:
        return {"skipped": "the mcp package is not installed (pip install -e '.[mcp]')"}
    return {**overhead(args.calls), **learning(args.steps, args.seed, args.smoke)}


def verifiers_part(args: argparse.Namespace) -> dict:
    try:
        import verifiers  # noqa: F401
    except ImportError:
        return {"skipped": "verifiers is not installed (pip install -e '.[verifiers]')"}
    from _verifiers_learning import choose, verifiers_learning
    from agent_learning import BATCH, CANDIDATES, SMOKE_BATCH, tool_model
    from agentic import smollm2_unavailable  # benchmarks/agentic.py

    missing = smollm2_unavailable()
    if missing:  # the repo's own models are char-level with 128 positions: the environment's prompts are longer
        return {"skipped": missing}
    model_dir = tool_model(args.cache)
    if args.smoke:  # one short step on the first candidate
        return verifiers_learning(model_dir, CANDIDATES[:1], 0.2, 4, args.seed, SMOKE_BATCH)
    tasks, table = choose(model_dir, args.choose, args.seed)
    if not tasks:
        return {"candidates": table, "error": "no candidate met the rule"}
    return {**verifiers_learning(model_dir, tasks, args.minutes, args.eval, args.seed, BATCH), "candidates": table}


def openenv_part(args: argparse.Namespace) -> dict:
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        return {"skipped": "openenv-core is not installed (pip install -e '.[openenv]')"}
    from postrl.config.agent import EnvAgent
    from postrl.controller.env_episodes import EnvEpisodes
    from postrl.controller.episode_scoring import environment_rewards
    from postrl.data.dataset import build_prompts
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.types import SamplingParams

    sys.path.insert(0, str(ROOT / "examples" / "openenv"))  # the app's module, as import_paths puts it
    app = "guess_server:app"
    agent = EnvAgent.model_validate(
        {"env": f"openenv:{app}", "env_options": {"reset_columns": ["seed"]}, "max_turns": 3,
         "max_tokens_per_turn": 8, "max_context": 128, "max_concurrent_episodes": 16}
    )  # fmt: skip
    tokenizer = load_tokenizer("demo")
    games = 8 if args.smoke else 64
    prompts = build_prompts(iter((f"seed {s}", {"prompt": "Play.", "seed": s}) for s in range(games)), tokenizer)
    engine = NativeRolloutWorker.from_hf(load_causal_lm("demo"), tokenizer, torch.float32, seed=args.seed)
    episodes = EnvEpisodes(agent, tokenizer, engine, None)  # type: ignore[arg-type] # the server scores
    try:
        began = time.perf_counter()
        rollouts = episodes.generate(prompts.prompts, SamplingParams(n=4, temperature=1.0, max_tokens=8), None)
        seconds = time.perf_counter() - began
    finally:
        episodes.close()
    firsts = [r for r in rollouts if r.episode is not None and r.episode.part == 0]
    rewards = environment_rewards(firsts)
    return {
        "env": f"openenv:{app} (served by postrl)",
        "episodes": len(firsts),
        "unscorable": sum(r.unscorable for r in rewards),
        "won": sum(r.reward == 1.0 for r in rewards),
        "turns_mean": round(sum(len(r.episode.turns) for r in firsts) / max(1, len(firsts)), 2),
        "episodes_per_min": round(60 * len(firsts) / seconds, 1),
        "processes_left": len(processes_with(f"uvicorn {app}")),
    }


def processes_with(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text.encode() in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=["mcp", "verifiers", "openenv"], help="default: all")
    parser.add_argument("--steps", type=int, default=80, help="the MCP run's steps")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--minutes", type=float, default=45.0, help="the verifiers run's training wall time")
    parser.add_argument("--eval", type=int, default=64, help="the verifiers environment's held-out problems")
    parser.add_argument("--choose", type=int, default=24, help="held-out problems per candidate for the rule")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "postrl-agent-learning")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.calls = 2, 12
    parts = {"mcp": mcp_part, "verifiers": verifiers_part, "openenv": openenv_part}
    result = {name: parts[name](args) for name in args.part or list(parts)}
    for name, figures in result.items():
        print(f"{name:28s} {'value':>12s}")
        for key, value in figures.items():
            if key != "candidates":
                print(f"  {key:26s} {value!s:>12s}")
    if "mcp" in result and "skipped" not in result["mcp"]:
        m = result["mcp"]
        print(
            f"MCP calculator: {m['mcp_ms_per_call']:.2f} ms a call against {m['in_process_ms_per_call']:.3f} ms "
            f"in-process; held-out success {m['success_before']:.3f} -> {m['success_after']:.3f} in {m['steps']} steps "
            f"({m['minutes']:.1f} min), {m['episodes_calling_share']:.0%} of training episodes called it, "
            f"{m['processes_left']} server processes left"
        )
    v = result.get("verifiers", {})
    if "success_after" in v:
        print(
            f"verifiers {v['env']}: held-out success {v['success_before']:.3f} -> {v['success_after']:.3f} over "
            f"{v['held_out']} problems, {v['steps']} steps ({v['minutes']:.1f} min), {v['retokenization_mismatches']} "
            f"mismatches, rubric_equal {v['rubric_equal']}"
        )
    o = result.get("openenv", {})
    if "episodes" in o:
        print(
            f"OpenEnv {o['env']}: {o['episodes']} episodes, {o['unscorable']} unscorable, "
            f"{o['episodes_per_min']} episodes/min, {o['processes_left']} server processes left"
        )
    if args.json:
        print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
