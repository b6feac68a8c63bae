"""Agents that learn: SmolLM2-135M-Instruct, warm-started to call tools, trained with GRPO through
unmodified agent frameworks (examples/agents/frameworks.py), on reasoning-gym tasks chosen by a rule.

Parts:
  warm start  the shipped adapter (assets/tool_adapter, built by scripts/build_tool_adapter.py)
              merged into SmolLM2 (``postrl merge-lora smollm2-tools``): warm_start_minutes is 0
              (shipped); its build time is in build_info.json and reported beside it.
  history     each history edit frameworks make (postrl.rollout.agentic.history_match.EDITS),
              through the recording server with a scripted engine: kept on the engine's tokens or not.
  frameworks  for each framework (--framework, default both): the tasks chosen by the RULE below on
              the warm start's held-out episodes through that framework, then ``postrl train``
              (agent.function, GRPO) for --minutes of training wall time, then the same held-out
              episodes again. Held-out problems are reasoning-gym's val split (never trained on).
              Success is the framework function's reward (the last number of the final answer
              equals the answer), sampled at the frameworks' own temperature (1.0), over --eval
              problems. Every trajectory of the held-out episodes after training is checked
              against the engine's calls (retokenization_mismatches: a trained span that is not
              exactly an engine call's response to exactly the trajectory before it).

  env         SmolLM2-135M-Instruct on TextArena's GuessTheNumber-v0 (a number in 1-20, ten guesses,
              "higher"/"lower" after each; a guess is a number in square brackets): each row a
              seed, i.e. a game; held-out success (greedy, the run's own validation) on --env-eval
              games whose seeds are never played in training, before and after --minutes of GRPO
              on the game's own reward (win 1). Chosen because it is offline (no corpora to
              download), single-player, scored by the game, multi-turn (the hints must be used),
              and the base model plays it badly but legally.

RULE: a candidate task (CANDIDATES: integer arithmetic of at least 3 operands, so that a problem needs
at least 2 calls of an add/subtract/multiply tool; with 2 operands, a run that picked them could
not reach 1.5 calls an episode) is chosen when the warm start's held-out success lies in 0.1-0.5
and at least half of its episodes call a tool; every candidate's figures are printed.

    python benchmarks/agent_learning.py [--framework agents_sdk] [--env] [--minutes 45] [--eval 48] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from _engine_calls import exactly_engine_calls, log_calls
from _smoke import add_smoke, skip

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "agents"))
sys.path.insert(0, str(ROOT / "benchmarks"))

CANDIDATES = [
    {"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 3}},
    {"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}},
    {"name": "products", "config": {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 2}},
    {
        "name": "basic_arithmetic",
        "config": {
            "min_terms": 3,
            "max_terms": 3,
            "min_digits": 2,
            "max_digits": 2,
            "operators": ["+", "-", "*"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    },  # fmt: skip
]
SUCCESS_RANGE, MIN_TOOL_SHARE = (0.1, 0.5), 0.5
FRAMEWORKS = {"agents_sdk": "agents_sdk", "langgraph": "langgraph_react"}
LR, MICRO = 2e-5, 4
BATCH, SMOKE_BATCH = (8, 4), (2, 2)  # prompts per step, samples per prompt (G)


def grpo(batch: tuple[int, int]) -> dict:
    """What both kinds of run share: GRPO, its batch, no checkpoints, metrics to metrics.jsonl only.
    The engine samples in float32, as the held-out evaluation does: a bf16 engine (what "auto" picks on
    a CPU with AMX) carried 3-5% of a 1e-5 update (train/update_visible_bf16), so it kept sampling
    from the warm start's weights and learned nothing in 9 steps."""
    prompts, g = batch
    return {
        "prompts_per_step": prompts,
        "rollout": {"n": g, "temperature": 1.0, "dtype": "float32"},
        "algorithm": {"kl_beta": 0.0},
        "train": {
            "lr": LR,
            "mini_batch_size": prompts * g,
            "micro_batch_size": min(MICRO, prompts * g),
            "precision": "bf16_autocast",
        },  # fmt: skip
        "checkpoint": {"every_steps": 0},
        "logging": {"eval_every": 0, "trackers": ["jsonl"], "console": False, "progress_bar": False},
        # the plan's RAM check sees the machine's free memory at start: a part run beside another
        # (--framework and --env in two processes) is warned, not refused
        "plan": {"check": "warn"},
    }


def tool_model(cache: Path) -> Path:
    """SmolLM2 with the shipped tool-calling adapter merged (made once per adapter)."""
    from postrl.models.merge_adapter import TOOL_ADAPTER_DIR, merge_adapter

    digest = hashlib.sha256((TOOL_ADAPTER_DIR / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]
    out = cache / f"smollm2-tools-{digest}"  # by content: a checkout or copy of the same adapter is the same
    if not (out / "config.json").is_file():
        merge_adapter("smollm2-tools", out)
    return out


def gym(tasks: list[dict], val_size: int, size: int = 4000) -> dict:
    return {"tasks": tasks, "size": size, "val_size": val_size, "seed": 0, "answer_format": "last_number"}


def held_out_prompts(model_dir: Path, tasks: list[dict], n: int) -> list:
    from postrl.config.data import DataConfig
    from postrl.data.prompt_source import prompt_source
    from postrl.models.loading import load_tokenizer

    data = DataConfig.model_validate({"reasoning_gym": gym(tasks, n), "apply_chat_template": False})
    held = prompt_source(data, load_tokenizer(str(model_dir))).held_out(lambda line: None)
    assert held is not None
    return held.prompts


def episodes(model_dir: Path, framework: str, prompts: list, seed: int) -> dict:
    """The framework's agent on ``prompts`` (one episode each) through a recording server over the
    native engine: success, tool calls, and every trajectory checked against the engine's calls."""
    import frameworks as examples  # examples/agents/frameworks.py

    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.agentic.agent_function import RecordedAgents
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.recording_server import RecordingServer
    from postrl.types import SamplingParams

    tokenizer = load_tokenizer(str(model_dir))
    engine = NativeRolloutWorker.from_hf(load_causal_lm(str(model_dir)), tokenizer, torch.float32, seed=seed)
    calls = log_calls(engine)
    agents = RecordedAgents(
        RecordingServer.of_engine(engine, tokenizer, tools_in_prompt="system"), getattr(examples, FRAMEWORKS[framework]),
        16, 600.0,
    )  # fmt: skip
    try:
        rollouts = agents.run(prompts, SamplingParams(n=1, temperature=1.0, max_tokens=examples.MAX_TOKENS))
    finally:
        agents.close()
    firsts = [r for r in rollouts if r.episode is not None and r.episode.part == 0]
    calls_per = [sum(len(m.get("tool_calls") or []) for m in r.episode.messages) for r in firsts]
    by_task: dict[str, list[float]] = {}
    for r in firsts:
        by_task.setdefault(prompts[r.prompt_index].task_type or "", []).append(float(r.episode.reward or 0.0))
    return {
        "success": sum(float(r.episode.reward or 0.0) for r in firsts) / max(1, len(firsts)),
        "per_task": {t: sum(v) / len(v) for t, v in by_task.items()},
        "tool_calls_per_episode": sum(calls_per) / max(1, len(firsts)),
        "tool_share": sum(c > 0 for c in calls_per) / max(1, len(firsts)),
        "retokenization_mismatches": sum(not exactly_engine_calls(r, calls) for r in rollouts if r.response_ids),
        "prefix_breaks": sum(r.episode.prefix_breaks for r in firsts),
        "history_edits": sum(sum(r.episode.history_edits.values()) for r in firsts),
        "episodes": len(firsts),
    }


def choose(model_dir: Path, framework: str, per_task: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The candidates the RULE picks for ``framework``, and every candidate's figures (kept beside the
    merged model: the same model, framework, size and seed choose the same)."""
    candidates = hashlib.sha256(json.dumps(CANDIDATES, sort_keys=True).encode()).hexdigest()[:8]
    kept = model_dir.parent / f"choose-{model_dir.name}-{framework}-{per_task}-{seed}-{candidates}.json"
    if kept.is_file():
        rows = json.loads(kept.read_text())
        print(f"  {framework}: the rule's figures from {kept}", file=sys.stderr)
        return [{"name": r["name"], "config": r["config"]} for r in rows if r["chosen"]], rows
    from postrl.data.dataset import DatasetError

    rows = []
    for cand in CANDIDATES:
        try:
            prompts = held_out_prompts(model_dir, [cand], per_task)
        except DatasetError as exc:  # e.g. a problem space so small that every held-out problem is trained on
            rows.append({**cand, "success": None, "tool_share": None, "chosen": False, "error": str(exc)})
            print(f"  {framework:11s} {cand['name']:17s} {json.dumps(cand['config']):105s} {exc}", file=sys.stderr)
            continue
        got = episodes(model_dir, framework, prompts, seed)
        ok = SUCCESS_RANGE[0] <= got["success"] <= SUCCESS_RANGE[1] and got["tool_share"] >= MIN_TOOL_SHARE
        rows.append({**cand, "success": got["success"], "tool_share": got["tool_share"], "chosen": ok})
        mark = "chosen" if ok else ""
        print(f"  {framework:11s} {cand['name']:17s} {json.dumps(cand['config']):105s} success "
              f"{got['success']:.3f} tool share {got['tool_share']:.2f} {mark}", file=sys.stderr)  # fmt: skip
    kept.write_text(json.dumps(rows))
    return [{"name": r["name"], "config": r["config"]} for r in rows if r["chosen"]], rows


def run_config(
    model_dir: Path, out: Path, framework: str, tasks: list[dict], val_size: int, seed: int, batch: tuple[int, int]
) -> dict:
    return {
        "name": f"agent-{framework}",
        "output_dir": str(out),
        "seed": seed,
        "steps": 10_000,  # the time budget ends the run (a signal, as a user's ^C)
        "import_paths": [str(ROOT / "examples" / "agents")],
        "model": {"path": str(model_dir)},
        "data": {"reasoning_gym": gym(tasks, val_size), "apply_chat_template": False},
        "agent": {
            "function": f"frameworks:{FRAMEWORKS[framework]}",
            "tools_in_prompt": "system",
            "max_context": 1024,
            "env_workers": batch[0] * batch[1],
        },  # fmt: skip
        **grpo(batch),
    }


def train_for(config, minutes: float, label: str) -> tuple[Path, int, float]:
    """``postrl train`` within ``minutes`` of step time (a SIGINT, as a user's ^C, after the last step
    that leaves room for another as long): the model it ended with, its steps, its minutes of step time."""
    from postrl.run.checkpoint import latest_checkpoint
    from postrl.run.interrupt import RunInterrupted
    from postrl.run.train_runner import train
    from postrl.types.metric_names import TIME_STEP_S

    state = {"wall": 0.0, "steps": 0}

    def on_step(metrics) -> None:
        state["wall"] += metrics.values[TIME_STEP_S]
        state["steps"] = metrics.step
        rss_gb = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
        print(f"  {label} step {metrics.step}: reward {metrics.values.get('reward/mean', float('nan')):.3f} "
              f"{state['wall'] / 60:.1f} min, RSS {rss_gb:.1f} GB", file=sys.stderr)  # fmt: skip
        if state["wall"] + metrics.values[TIME_STEP_S] > minutes * 60:
            os.kill(os.getpid(), signal.SIGINT)  # a next step as long would pass the budget: stop after this one

    try:
        train(config, on_step=on_step)
        final = config.run_dir / "final_model"
    except RunInterrupted:
        final = latest_checkpoint(config.run_dir) / "model"
    return final, int(state["steps"]), state["wall"] / 60


def learn(
    model_dir: Path, framework: str, tasks: list[dict], minutes: float, n_eval: int, seed: int, batch: tuple[int, int]
) -> dict:
    from postrl.config.loading import build_config

    prompts = held_out_prompts(model_dir, tasks, n_eval)
    before = episodes(model_dir, framework, prompts, seed)
    out = Path(tempfile.mkdtemp(prefix=f"agent-learning-{framework}-"))
    config = run_config(model_dir, out, framework, tasks, n_eval, seed, batch)
    began = time.perf_counter()
    final, steps, minutes_run = train_for(build_config(config), minutes, framework)
    wall = time.perf_counter() - began
    after = episodes(final, framework, prompts, seed)
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint is 2.2 GB (float32 weights and AdamW state)
    return {
        "tasks": tasks,
        **learning_figures(before, after),
        "history_edits": before["history_edits"] + after["history_edits"],
        "steps": steps,
        "minutes": round(minutes_run, 2),
        "run_minutes": round(wall / 60, 2),
        "threads": torch.get_num_threads(),
    }


def learning_figures(before: dict, after: dict) -> dict:
    """The held-out figures of a tool-learning run, before and after training: success (overall and
    per task), tool calls per episode, and the token-exactness counts of both evaluations."""
    return {
        "success_before": round(before["success"], 4),
        "success_after": round(after["success"], 4),
        "per_task_before": before["per_task"],
        "per_task_after": after["per_task"],
        "tool_calls_per_episode_before": round(before["tool_calls_per_episode"], 3),
        "tool_calls_per_episode": round(after["tool_calls_per_episode"], 3),
        "retokenization_mismatches": before["retokenization_mismatches"] + after["retokenization_mismatches"],
        "prefix_breaks": before["prefix_breaks"] + after["prefix_breaks"],
        "held_out": after["episodes"],
    }


ENV = "textarena:GuessTheNumber-v0"
ENV_TURNS, ENV_TOKENS = 10, 32


def env_config(model_dir: Path, out: Path, train: Path, val: Path, seed: int, batch: tuple[int, int]) -> dict:
    """GRPO on a TextArena single-player game: each row a seed (its game), the held-out rows' seeds
    never played in training."""
    return {
        "name": "env-" + ENV.split(":")[1].lower(),
        "output_dir": str(out),
        "seed": seed,
        "steps": 10_000,  # the time budget ends the run
        "model": {"path": str(model_dir)},
        "data": {"train_files": [str(train)], "val_files": [str(val)]},
        "agent": {
            "env": ENV,
            "max_turns": ENV_TURNS,
            "max_tokens_per_turn": ENV_TOKENS,
            "max_context": 2048,
            "on_turn_length": "continue",
            "env_workers": batch[0] * batch[1],
        },  # fmt: skip
        **grpo(batch),
    }


def env_learning(model_dir: Path, minutes: float, n_eval: int, seed: int, batch: tuple[int, int]) -> dict:
    """SmolLM2 on the game: held-out success (greedy, the run's own validation) before and after
    ``minutes`` of training."""
    from postrl.config.loading import build_config
    from postrl.controller.env_episodes import EnvEpisodes
    from postrl.data.prompt_source import prompt_source
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.run.resolve import resolved_run
    from postrl.run.validation import Validator, load_validation_set

    out = Path(tempfile.mkdtemp(prefix="agent-learning-env-"))
    rows = {"train": range(1, 5001), "val": range(100_001, 100_001 + n_eval)}  # disjoint seeds: other games
    for split, seeds in rows.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": "play", "seed": s}) + "\n" for s in seeds))
    config = resolved_run(build_config(env_config(model_dir, out, out / "train.jsonl", out / "val.jsonl", seed, batch)))
    tokenizer = load_tokenizer(str(model_dir))
    validator = Validator(config, load_validation_set(config, prompt_source(config.data, tokenizer), lambda _: None))

    def held_out(path: Path) -> dict[str, float]:
        engine = NativeRolloutWorker.from_hf(load_causal_lm(str(path)), tokenizer, torch.float32, seed=seed)
        episodes = EnvEpisodes(config.agent, tokenizer, engine, None)  # type: ignore[arg-type] # the env scores
        return validator.run(episodes, None)

    before = held_out(model_dir)
    final, steps, minutes_run = train_for(config, minutes, "env")
    after = held_out(final)
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint is 2.2 GB
    return {
        "name": ENV,
        "success_before": round(before["val/accuracy"], 4),
        "success_after": round(after["val/accuracy"], 4),
        "turns_before": round(before["val/agent/turns_mean"], 2),
        "turns_after": round(after["val/agent/turns_mean"], 2),
        "held_out_games": n_eval,
        "steps": steps,
        "minutes": round(minutes_run, 2),
        "threads": torch.get_num_threads(),
    }


def history_edits() -> list[dict]:
    """Each framework edit (and a template that drops earlier reasoning) through the recording server
    with a scripted engine, on Qwen2.5's template and on SmolLM2's with the tools in a system
    message: ``tests/test_history_edits.py``'s cases, each kept exact (one sample on the engine's
    tokens, no prefix break, the edit counted) or not."""
    import pytest

    sys.path.insert(0, str(ROOT))
    collect = _Collect()
    pytest.main(["-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_history_edits.py"), "-k",
                 "each_framework_edit or drops_earlier_reasoning"], plugins=[collect])  # fmt: skip
    rows = []
    for nodeid, passed in sorted(collect.results.items()):
        name = nodeid.split("::")[-1]
        if "[" in name:  # test_each_framework_edit_...[TEMPLATE-EDIT]
            template, _, edit = name[name.index("[") + 1 : -1].rpartition("-")
        else:
            template, edit = "qwen3", "template_drops_reasoning"
        rows.append({"edit": edit, "template": template, "kept_exact": passed})
    assert len(rows) == 9, rows
    return rows


class _Collect:
    def __init__(self) -> None:
        self.results: dict[str, bool] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call":
            self.results[report.nodeid] = report.passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", action="append", choices=sorted(FRAMEWORKS), help="default: all")
    parser.add_argument("--minutes", type=float, default=45.0, help="training wall time per framework")
    parser.add_argument("--eval", type=int, default=96, help="held-out problems, over the chosen tasks")
    parser.add_argument("--choose", type=int, default=24, help="held-out problems per candidate for the rule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "postrl-agent-learning")
    parser.add_argument("--env", action="store_true", help="the environment part only")
    parser.add_argument("--env-eval", type=int, default=100, help="held-out games")
    parser.add_argument("--model", type=Path, default=None, help="the environment part's model (default: SmolLM2)")
    parser.add_argument("--json", action="store_true")
    add_smoke(parser)
    args = parser.parse_args()
    from agentic import smollm2_unavailable  # benchmarks/agentic.py

    from postrl.models.merge_adapter import TOOL_ADAPTER_DIR

    missing = smollm2_unavailable()
    if missing:
        skip(missing, args.json)
        return

    batch = SMOKE_BATCH if args.smoke else BATCH  # smoke: one short step, the same code path
    info = json.loads((TOOL_ADAPTER_DIR / "build_info.json").read_text())
    model_dir = tool_model(args.cache)
    result: dict = {"warm_start_minutes": 0, "warm_start_build_minutes": info["build_minutes"],
                    "warm_start_check": info["check"], "history_edits": history_edits(), "frameworks": {}}  # fmt: skip
    if args.env or not args.framework:
        from postrl.models.gguf import smollm2_dir

        result["env"] = env_learning(args.model or smollm2_dir(), 0.2 if args.smoke else args.minutes,
                                     4 if args.smoke else args.env_eval, args.seed, batch)  # fmt: skip
    chosen = args.framework or (["agents_sdk"] if args.smoke else sorted(FRAMEWORKS))  # smoke: one is enough
    for framework in [] if args.env else chosen:
        if args.smoke:
            tasks, table = CANDIDATES[:1], []
        else:
            tasks, table = choose(model_dir, framework, args.choose, args.seed)
        if not tasks:
            result["frameworks"][framework] = {"candidates": table, "error": "no candidate met the rule"}
            continue
        minutes = 0.2 if args.smoke else args.minutes
        got = learn(model_dir, framework, tasks, minutes, 4 if args.smoke else args.eval, args.seed, batch)
        result["frameworks"][framework] = {**got, "candidates": table}
    print(
        f"{'framework':12s}{'tasks':40s}{'before':>8s}{'after':>8s}{'calls/ep':>9s}{'mism':>6s}{'breaks':>7s}{'min':>7s}"
    )
    for name, r in result["frameworks"].items():
        if "error" in r:
            print(f"{name:12s}{r['error']}")
            continue
        tasks = ",".join(t["name"] for t in r["tasks"])
        print(f"{name:12s}{tasks:40s}{r['success_before']:8.3f}{r['success_after']:8.3f}"
              f"{r['tool_calls_per_episode']:9.2f}{r['retokenization_mismatches']:6d}{r['prefix_breaks']:7d}"
              f"{r['minutes']:7.1f}")  # fmt: skip
    if "env" in result:
        e = result["env"]
        print(f"env {e['name']}: held-out success {e['success_before']:.3f} -> {e['success_after']:.3f} over "
              f"{e['held_out_games']} games never played, {e['steps']} steps, {e['minutes']:.1f} min")  # fmt: skip
    for row in result["history_edits"]:
        print(f"history edit {row['edit']:26s} {row['template']:16s} kept exact: {row['kept_exact']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
