"""Two trainable policies in one run: the arithmetic chain of examples/agents/arithmetic_chain.py.

``first`` adds a+b, ``second`` adds c to the first's answer; each trains on its own turns with GRPO,
rewarded for its own step (``postrl train`` with ``policies: {first, second}``, both from the
shipped demo model). Each policy is scored against a fixed reference before and after, greedy, on
held-out problems never trained on: ``first`` on ``a+b=``, ``second`` on ``x+c=`` where x is the
right a+b (the scripted partner), so one policy's progress never counts as the other's. The team
score (both steps right, the trained pair together) is reported beside them. Afterwards the trained
pair plays the held-out episodes through the recording server once more, every engine call
logged: ``retokenization_mismatches`` counts trained spans that are not exactly their own policy's
engine call (another policy's tokens in a sample, or a re-tokenized turn).

Run: ``.venv/bin/python benchmarks/multi_policy.py --json`` (``--steps``, ``--prompts``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "agents"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import arithmetic_chain as chain  # noqa: E402
from _engine_calls import exactly_engine_calls, log_calls  # noqa: E402
from _smoke import add_smoke  # noqa: E402

POLICIES = ("first", "second")


def greedy_scores(models: dict[str, Path], held_out: list[dict]) -> dict[str, float]:
    """Each policy's held-out accuracy in its role against the fixed reference, and the team's."""
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.types import Prompt, SamplingParams

    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)

    def answers(policy: str, texts: list[str]) -> list[int | None]:
        tokenizer = load_tokenizer(str(models[policy]))
        engine = NativeRolloutWorker.from_hf(load_causal_lm(str(models[policy])), tokenizer, torch.float32)
        prompts = [Prompt(t, tokenizer(t)["input_ids"]) for t in texts]  # BOS + text: the plain template's
        return [chain.answer_in(r.text) for r in engine.generate(prompts, greedy, None)]

    rows = [(int(r["a"]), int(r["b"]), int(r["c"])) for r in held_out]
    first = answers("first", [f"{a}+{b}=" for a, b, _ in rows])
    second = answers("second", [f"{a + b}+{c}=" for a, b, c in rows])
    relay = answers("second", [f"{x if x is not None else 0}+{c}=" for x, (_, _, c) in zip(first, rows)])
    n = len(rows)
    return {
        "first": sum(x == a + b for x, (a, b, _) in zip(first, rows)) / n,
        "second": sum(y == a + b + c for y, (a, b, c) in zip(second, rows)) / n,
        "team": sum(x == a + b and y == a + b + c for x, y, (a, b, c) in zip(first, relay, rows)) / n,
    }


def recorded_mismatches(models: dict[str, Path], held_out: list[dict]) -> dict[str, int]:
    """The trained pair's held-out episodes through the recording server, every engine call logged:
    spans of a policy's samples that are not exactly one of its own engine's calls, and samples."""
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.agentic.agent_function import RecordedAgents
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.recording_server import RecordingServer, ServedPolicy
    from postrl.types import Prompt, SamplingParams

    served, calls = {}, {}
    for policy in POLICIES:
        tokenizer = load_tokenizer(str(models[policy]))
        engine = NativeRolloutWorker.from_hf(load_causal_lm(str(models[policy])), tokenizer, torch.float32)
        calls[policy] = log_calls(engine)
        served[policy] = ServedPolicy(engine, tokenizer)
    agents = RecordedAgents(RecordingServer(served), chain.chain, 16, 120.0)
    try:
        prompts = [Prompt(r["prompt"], [], columns=r) for r in held_out]
        out = agents.run_policies(prompts, SamplingParams(n=1, temperature=1.0, max_tokens=16))
    finally:
        agents.close()
    return {
        "mismatches": sum(not exactly_engine_calls(r, calls[p]) for p in POLICIES for r in out[p] if r.response_ids),
        "samples": sum(len(out[p]) for p in POLICIES),
    }


def train(out: Path, model: Path, data: Path, steps: int, prompts: int, seed: int) -> tuple[Path, list[dict], float]:
    from postrl.config.loading import load_config
    from postrl.config.run import RunConfig
    from postrl.run.train_runner import train as train_run

    overrides = [
        f"output_dir={out}",
        "name=chain",
        f"steps={steps}",
        f"prompts_per_step={prompts}",
        f"seed={seed}",
        f"model.path={model}",
        f"data.train_files=[{data}]",
        "logging.trackers=[jsonl]",
        f"import_paths=[{ROOT / 'examples' / 'agents'}]",
        "checkpoint.every_steps=0",
    ]
    config = load_config(ROOT / "examples" / "agents" / "two_policies.yaml", overrides, model=RunConfig)
    began = time.perf_counter()
    train_run(config, overwrite=True)
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    return config.run_dir, rows, wall


def one_seed(out: Path, seed: int, steps: int, prompts: int, n_eval: int) -> dict:
    """A whole measurement on the data and run of ``seed``: scores before, the run, scores after."""
    shutil.rmtree(out, ignore_errors=True)
    model = chain.make_model(out / "model")
    train_file, held_out_file = chain.write_data(out / "data", held_out=n_eval, seed=seed)
    held_out = [json.loads(line) for line in held_out_file.read_text().splitlines()]
    before = greedy_scores({p: model for p in POLICIES}, held_out)
    run_dir, rows, wall = train(out / "runs", model, train_file, steps, prompts, seed)
    trained = {p: run_dir / "final_model" / p for p in POLICIES}
    after = greedy_scores(trained, held_out)
    recorded = recorded_mismatches(trained, held_out)
    return {
        "seed": seed,
        "before": before,
        "after": after,
        "samples": {p: int(sum(r[f"{p}/reward/samples"] for r in rows)) for p in POLICIES},
        "mismatches": recorded["mismatches"],
        "checked": recorded["samples"],
        "steps": len(rows),
        "train_minutes": wall / 60,
        "held_out": len(held_out),
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--steps", type=int, default=100, help="RL steps (each trains both policies)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (8 episodes each)")
    parser.add_argument("--eval", type=int, default=200, help="held-out problems")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="data and run seeds, one run each")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "postrl-multi-policy")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.prompts, args.eval, args.seeds = 2, 2, 8, [0]
    torch.set_num_threads(2)
    began = time.perf_counter()
    runs = [one_seed(args.out / f"seed{seed}", seed, args.steps, args.prompts, args.eval) for seed in args.seeds]
    result: dict = {"policies": list(POLICIES), "seeds": args.seeds}
    for p in (*POLICIES, "team"):
        gains = [r["after"][p] - r["before"][p] for r in runs]
        result[p] = {
            "score_before": round(mean([r["before"][p] for r in runs]), 4),
            "score_after": round(mean([r["after"][p] for r in runs]), 4),
            "gain": round(mean(gains), 4),
            "gain_min": round(min(gains), 4),
            "gain_max": round(max(gains), 4),
            "per_seed": [(round(r["before"][p], 4), round(r["after"][p], 4)) for r in runs],
        }
    result |= {
        "samples_per_policy": {p: sum(r["samples"][p] for r in runs) for p in POLICIES},
        "retokenization_mismatches": sum(r["mismatches"] for r in runs),
        "checked_samples": sum(r["checked"] for r in runs),
        "steps": runs[0]["steps"],
        "train_minutes": round(max(r["train_minutes"] for r in runs), 2),
        "minutes": round((time.perf_counter() - began) / 60 / len(runs), 2),  # one seed's whole measurement
        "minutes_all_seeds": round((time.perf_counter() - began) / 60, 2),
        "held_out": runs[0]["held_out"],
        "threads": torch.get_num_threads(),
    }
    print(
        f"arithmetic chain, {result['held_out']} held-out problems, greedy, each policy against a fixed reference; "
        f"seeds {args.seeds}"
    )
    print(
        f"{'policy':10s}{'before':>8s}{'after':>8s}{'gain':>8s}{'min gain':>10s}{'max gain':>10s}  per seed (before, after)"
    )
    for p in (*POLICIES, "team"):
        r = result[p]
        print(
            f"{p:10s}{r['score_before']:8.3f}{r['score_after']:8.3f}{r['gain']:+8.3f}{r['gain_min']:+10.3f}"
            f"{r['gain_max']:+10.3f}  {r['per_seed']}"
        )
    print(
        f"{result['steps']} steps in {result['train_minutes']} min at most; {result['minutes']} min per seed in all; "
        f"retokenization mismatches {result['retokenization_mismatches']} of {result['checked_samples']} samples; "
        f"samples per policy {result['samples_per_policy']}"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
