"""env_hubs.py's verifiers part: a verifiers tool environment (examples/verifiers/arith_tools.py, a
ToolEnv with add/subtract/multiply and a rubric) on which the shipped tool-calling warm start of
SmolLM2-135M-Instruct is trained through ``agent.verifiers``, unmodified.

RULE (agent_learning.py's, through this environment): a candidate task (agent_learning.CANDIDATES,
integer arithmetic of at least 3 operands) is chosen when the warm start's held-out success on the
environment's eval split lies in 0.1-0.5 and at least half of its episodes call a tool.

Held-out success: one episode per eval row (sampled at temperature 1.0, as the frameworks' part),
its reward the rubric's. Every trained span of those episodes is checked against the engine's calls
(retokenization_mismatches), and every reward against verifiers' own scoring of the same
completion by a fresh Rubric of the environment's function (rubric_equal)."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _engine_calls import exactly_engine_calls, log_calls

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "verifiers"
SPEC = "arith_tools:load_environment"
MAX_TOKENS = 96  # per model call, as the frameworks' agents


def environment(tasks: list[dict], eval_size: int, seed: int) -> Any:
    sys.path.insert(0, str(EXAMPLES))
    from postrl.config.agent import VerifiersAgent
    from postrl.rollout.agentic.verifiers_env import load_environment

    args = {"tasks": tasks, "eval_size": eval_size, "seed": seed}
    return load_environment(VerifiersAgent(verifiers=SPEC, verifiers_args=args))


def verifiers_rewards(rows: list[dict], completions: list[list[dict]]) -> list[float]:
    """verifiers' own scoring: a fresh ``vf.Rubric`` of the environment's reward function over a
    verifiers State of each row holding the recorded completion."""
    import arith_tools
    import verifiers as vf
    from verifiers.utils.message_utils import normalize_messages

    rubric = vf.Rubric(funcs=[arith_tools.correct_answer])

    async def score(row: dict, completion: list[dict]) -> float:
        state = vf.State(input=dict(row))
        state["completion"] = normalize_messages(completion, field_name="completion")
        state["trajectory"] = []
        await rubric.score_group([state])
        return float(state["reward"])

    return [asyncio.run(score(row, c)) for row, c in zip(rows, completions, strict=True)]


def answers(messages: list[dict]) -> list[dict]:
    """The model's messages of a recorded transcript, as text (what the rubric reads)."""
    return [{"role": "assistant", "content": m.get("content") or ""} for m in messages if m["role"] == "assistant"]


def episodes(model_dir: Path, env: Any, seed: int) -> dict:
    """One episode per eval row through ``agent.verifiers``' own runner over the native engine."""
    from postrl.controller.episode_scoring import environment_rewards
    from postrl.data.dataset import build_prompts
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.agentic.verifiers_env import VerifiersGroups, environment_rows
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.recording_server import RecordingServer
    from postrl.types import SamplingParams

    tokenizer = load_tokenizer(str(model_dir))
    prompts = build_prompts(environment_rows(env, "eval"), tokenizer, max_prompt_tokens=1024).prompts
    engine = NativeRolloutWorker.from_hf(load_causal_lm(str(model_dir)), tokenizer, torch.float32, seed=seed)
    calls = log_calls(engine)
    groups = VerifiersGroups(RecordingServer.of_engine(engine, tokenizer, "system", 1024), env, 16, 600.0)
    try:
        rollouts = groups.run(prompts, SamplingParams(n=1, temperature=1.0, max_tokens=MAX_TOKENS))
    finally:
        groups.close()
    firsts = [r for r in rollouts if r.episode is not None and r.episode.part == 0]
    rewards = [res.reward for res in environment_rewards(firsts)]
    scored = [(r, w) for r, w in zip(firsts, rewards, strict=True) if w is not None]
    rows = [prompts[r.prompt_index].columns["verifiers_row"] for r, _ in scored]
    theirs = verifiers_rewards(rows, [answers(r.episode.messages) for r, _ in scored])
    by_task: dict[str, list[float]] = {}
    for r, w in zip(firsts, rewards, strict=True):
        by_task.setdefault(prompts[r.prompt_index].columns["verifiers_row"]["info"]["family"], []).append(w or 0.0)
    calls_per = [r.episode.metrics.get("total_tool_calls", 0.0) for r in firsts]
    return {
        "success": sum(w or 0.0 for w in rewards) / max(1, len(firsts)),
        "per_task": {t: sum(v) / len(v) for t, v in by_task.items()},
        "tool_calls_per_episode": sum(calls_per) / max(1, len(firsts)),
        "tool_share": sum(c > 0 for c in calls_per) / max(1, len(firsts)),
        "unscorable": sum(w is None for w in rewards),
        "retokenization_mismatches": sum(not exactly_engine_calls(r, calls) for r in rollouts if r.response_ids),
        "prefix_breaks": sum(r.episode.prefix_breaks for r in firsts),
        "rubric_equal": all(abs(w - v) < 1e-9 for (_, w), v in zip(scored, theirs, strict=True)),
        "episodes": len(firsts),
    }


def choose(model_dir: Path, per_task: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The candidates the RULE picks, and every candidate's figures."""
    from agent_learning import CANDIDATES, MIN_TOOL_SHARE, SUCCESS_RANGE

    chosen, rows = [], []
    for cand in CANDIDATES:
        got = episodes(model_dir, environment([cand], per_task, seed), seed)
        ok = SUCCESS_RANGE[0] <= got["success"] <= SUCCESS_RANGE[1] and got["tool_share"] >= MIN_TOOL_SHARE
        rows.append({**cand, "success": got["success"], "tool_share": got["tool_share"], "chosen": ok})
        chosen += [cand] if ok else []
        print(f"  verifiers {cand['name']:17s} {cand['config']} success {got['success']:.3f} "
              f"tool share {got['tool_share']:.2f} {'chosen' if ok else ''}", file=sys.stderr)  # fmt: skip
    return chosen, rows


def run_config(model_dir: Path, out: Path, tasks: list[dict], n_eval: int, seed: int, batch: tuple[int, int]) -> dict:
    from agent_learning import grpo

    return {
        "name": "verifiers-arith",
        "output_dir": str(out),
        "seed": seed,
        "steps": 10_000,  # the time budget ends the run
        "import_paths": [str(EXAMPLES)],
        "model": {"path": str(model_dir)},
        "agent": {
            "verifiers": SPEC,
            "verifiers_args": {"tasks": tasks, "eval_size": n_eval, "seed": seed},
            "tools_in_prompt": "system",
            "max_context": 1024,
            "env_workers": batch[0] * batch[1],
        },
        **grpo(batch),
        "rollout": {**grpo(batch)["rollout"], "max_tokens": MAX_TOKENS},
    }


def verifiers_learning(
    model_dir: Path, tasks: list[dict], minutes: float, n_eval: int, seed: int, batch: tuple[int, int]
) -> dict:
    """Held-out success on the environment's eval split before and after ``minutes`` of training."""
    from agent_learning import learning_figures, train_for

    from postrl.config.loading import build_config

    env = environment(tasks, n_eval, seed)
    before = episodes(model_dir, env, seed)
    out = Path(tempfile.mkdtemp(prefix="env-hubs-verifiers-"))
    began = time.perf_counter()
    config = build_config(run_config(model_dir, out, tasks, n_eval, seed, batch))
    final, steps, minutes_run = train_for(config, minutes, "verifiers")
    wall = time.perf_counter() - began
    after = episodes(final, env, seed)
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint is 2.2 GB (float32 weights and AdamW state)
    return {
        "env": f"{SPEC} ({', '.join(t['name'] for t in tasks)})",
        "tasks": tasks,
        **learning_figures(before, after),
        "unscorable": before["unscorable"] + after["unscorable"],
        "rubric_equal": before["rubric_equal"] and after["rubric_equal"],
        "steps": steps,
        "minutes": round(minutes_run, 2),
        "run_minutes": round(wall / 60, 2),
    }
