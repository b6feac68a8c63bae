"""How far the engine's numbers are from the trainer's: logprobs, weights, reproducibility, cost.

Issue 43, part 3: with ``rollout.exact`` the native engine's logprob of every sampled token equals
the trainer's recomputation bit for bit, in float32 and in bf16 (batch-invariant operations on both
sides, :mod:`postrl.models.invariant`). Measured here:

- ``max_abs_diff_fp32`` / ``max_abs_diff_bf16``: the largest |engine logprob - trainer logprob|
  over the steps of a GRPO run of SmolLM2-135M-Instruct on reasoning-gym sums
  (``rollout/logprob_diff_max``, the trainer computing every sampled token), with ``rollout.exact``,
  engine and trainer in float32, then bf16 (bf16 autocast training); ``default_max_abs_diff_bf16``
  and ``default_max_abs_diff_fp32``: the same without exact mode (bf16 is the default on CPUs with
  fast bf16). ``max_abs_diff_agentic``: the same over an agent step of individually scheduled
  multi-turn episodes (the shipped ``agentic-demo`` model on the calculator environment, float32,
  exact). ``tokens_compared_*``: the sampled tokens each covers.
- ``reproducible``: two exact runs of the agent step with the same seed give the same tokens and
  the same metrics, bit for bit (timings aside), individually scheduled episodes included.
- ``update_survives_sync_fraction``: one AdamW step (lr ``LR``) of SmolLM2 by the trainer, then the
  weights synced into a native engine: the share of the change in the weights the trainer's forward
  computes with (after its casts) that the engine's copy carries, ``1 - |dE - dT| / |dT|``, with
  exact mode (fp32, bf16; 1.0 when exact) and without (``default_update_survives_sync_fraction``:
  bf16 autocast leaves the norms' weights in float32, which the bf16 engine rounds).
- ``master_update_visible_bf16``: of the float32 master weights' change in that step, the share
  that survives rounding to bf16 (``train/update_visible_bf16``): a bf16 engine only ever sees that.
- ``exact_step_time_ratio``: exact over default step time (the last step of each run, each with
  its own ``algorithm.old_logprobs: auto``), on the demo and on SmolLM2, float32 and bf16;
  ``exact_step_time_ratio_max`` the largest.

    python benchmarks/mismatch.py [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _smoke import add_smoke, skip

LR = 5e-6
GYM = {
    "tasks": [
        {
            "name": "basic_arithmetic",
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"]},
        }
    ],
    "answer_format": "last_number",
    "size": 200,
    "val_size": 0,
}


def run_steps(config: dict) -> tuple[list[dict[str, float]], list[list]]:
    """A ``postrl train`` run: each step's metrics and every sample's (prompt index, response), in order."""
    from postrl.config.loading import build_config
    from postrl.run.metrics import read_metrics
    from postrl.run.train_runner import train

    train(build_config(config))
    run = Path(config["output_dir"]) / config["name"]
    samples = [
        [json.loads(line)[k] for k in ("prompt_index", "response", "reward")]
        for f in sorted((run / "samples").glob("step_*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    metrics = read_metrics(run / "metrics.jsonl")
    shutil.rmtree(run)  # its checkpoint and final model: gigabytes for SmolLM2
    return metrics, samples


LOGGING = {"trackers": ["jsonl"], "console": False, "progress_bar": False}


def precision_of(dtype: str) -> str:
    return "float32" if dtype == "float32" else "bf16_autocast"


def single_turn(out: Path, name: str, dtype: str, exact: bool, smoke: bool) -> dict:
    from postrl.models.gguf import smollm2_dir

    return {
        "name": name,
        "output_dir": str(out),
        "seed": 0,
        "steps": 1 if smoke else 2,
        "prompts_per_step": 2 if smoke else 12,
        "model": {"path": str(smollm2_dir())},
        "data": {"reasoning_gym": GYM, "max_prompt_tokens": 256},
        "rollout": {
            "n": 2 if smoke else 8,
            "max_tokens": 8 if smoke else 48,
            "temperature": 1.0,
            "dtype": dtype,
            "exact": exact,
        },
        "reward": {"components": [{"name": "correct", "type": "reasoning_gym"}], "num_workers": 1},
        "algorithm": {"kl_beta": 0.0},
        "train": {
            "lr": LR,
            "precision": precision_of(dtype),
            "mini_batch_size": 4 if smoke else 96,
            "micro_batch_size": 4 if smoke else 16,
        },
        "checkpoint": {"every_steps": 0},
        "logging": LOGGING,
    }


def demo(out: Path, name: str, dtype: str, exact: bool, smoke: bool) -> dict:
    from postrl.run.demo import DEMO_SETTINGS

    settings = {**DEMO_SETTINGS, "name": name, "output_dir": str(out), "steps": 1 if smoke else 3}
    settings["rollout"] = {**DEMO_SETTINGS["rollout"], "dtype": dtype, "exact": exact}
    settings["train"] = {**DEMO_SETTINGS["train"], "precision": precision_of(dtype)}
    if smoke:
        settings["prompts_per_step"] = 4
        settings["train"] = {**settings["train"], "mini_batch_size": 32, "micro_batch_size": 32}
    return {**settings, "logging": LOGGING}


def agentic(out: Path, name: str, smoke: bool) -> dict:
    return {
        "name": name,
        "output_dir": str(out),
        "seed": 0,
        "steps": 1,
        "prompts_per_step": 2 if smoke else 48,
        "model": {"path": "agentic-demo"},
        "data": {"task": "calculator"},
        "rollout": {"n": 2 if smoke else 4, "temperature": 1.0, "max_tokens": 40, "dtype": "float32", "exact": True},
        "agent": {
            "env": "calculator",
            "max_turns": 3,
            "max_tokens_per_turn": 40,
            "max_context": 128,
            "tools_in_prompt": "none",
            "scheduling": "individual",
        },
        "train": {
            "lr": 1e-4,
            "precision": "float32",
            "mini_batch_size": 4 if smoke else 192,
            "micro_batch_size": 4 if smoke else 32,
        },
        "checkpoint": {"every_steps": 0},
        "logging": LOGGING,
    }


def tokens(metrics: dict[str, float]) -> int:
    from postrl.types.metric_names import RESPONSE_LENGTH_MEAN, REWARD_SAMPLES

    return round(metrics[RESPONSE_LENGTH_MEAN] * metrics[REWARD_SAMPLES])


def sync_survival(precision: str, engine_dtype: torch.dtype, exact: bool, smoke: bool) -> tuple[float, float | None]:
    """One update of SmolLM2 on a synthetic batch, synced into a native engine of ``engine_dtype``:
    the share of the trainer-side change the engine carries, and the bf16-visible share of the
    master weights' change."""
    from postrl.config.run import AlgorithmConfig, TrainConfig
    from postrl.models.gguf import smollm2_dir
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.train.worker import PolicyTrainer
    from postrl.types import Experience, ExperienceBatch
    from postrl.types.metric_names import TRAIN_UPDATE_VISIBLE_BF16

    tokenizer = load_tokenizer(str(smollm2_dir()))
    model = load_causal_lm(str(smollm2_dir())).to(torch.float32)
    engine = NativeRolloutWorker.from_hf(model, tokenizer, engine_dtype, exact=exact)
    algorithm = AlgorithmConfig(kl_beta=0.0, old_logprobs="recompute", importance={"type": "none"})
    rows = 4 if smoke else 16
    train = TrainConfig(lr=LR, precision=precision, mini_batch_size=rows, micro_batch_size=rows)
    trainer = PolicyTrainer(model, train, algorithm, max_response_tokens=24, seed=0, proximal="recompute", exact=exact)
    gen = torch.Generator().manual_seed(0)
    experiences = []
    for i in range(rows):
        prompt = tokenizer.encode(f"What is {i // 4} + {2 * (i // 4)}?")  # a group shares its prompt
        response = torch.randint(100, 20_000, (24,), generator=gen).tolist()
        experiences.append(
            Experience(prompt, response, [0.0] * 24, float(i % 2), 1.0 if i % 2 else -1.0, 0, group_id=i // 4)
        )
    batch = ExperienceBatch.from_experiences(experiences, tokenizer.pad_token_id or 0)
    autocast = precision == "bf16_autocast"

    def computed_with() -> dict[str, torch.Tensor]:
        """The weights the trainer's forward multiplies by: autocast casts the matmul weights to bf16
        and leaves the norms' in float32; the exact forward rounds every weight to bf16."""
        out = {}
        for name, p in model.named_parameters():
            w = p.detach().clone()
            out[name] = w.to(torch.bfloat16).float() if autocast and (exact or w.dim() == 2) else w
        return out

    before, engine_before = computed_with(), {n: t.float().clone() for n, t in engine.model.params.items()}
    metrics = trainer.update(batch)
    engine.update_weights({n: p.detach() for n, p in model.named_parameters()}, 1)
    after, engine_after = computed_with(), {n: t.float().clone() for n, t in engine.model.params.items()}
    diff = total = 0.0
    for name in engine_after:
        trained = after[name] - before[name]
        carried = engine_after[name] - engine_before[name]
        diff += float(((carried - trained).double() ** 2).sum())
        total += float((trained.double() ** 2).sum())
    engine.close()
    return 1.0 - (diff**0.5) / (total**0.5), metrics.values.get(TRAIN_UPDATE_VISIBLE_BF16)


TIMING = ("time/", "throughput/", "perf/", "_s", "memory/")


def largest(runs: list[dict[str, float]]) -> float:
    """The largest engine-trainer logprob gap over a run's steps."""
    from postrl.types.metric_names import ROLLOUT_LOGPROB_DIFF_MAX

    return max(m[ROLLOUT_LOGPROB_DIFF_MAX] for m in runs)


def counted(runs: list[dict[str, float]]) -> int:
    return sum(tokens(m) for m in runs)


def untimed(runs: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each step's metrics but its timings and memory (which vary run to run)."""
    return [{k: v for k, v in m.items() if not any(t in k for t in TIMING)} for m in runs]


def step_time(metrics: list[dict[str, float]]) -> float:
    return metrics[-1]["time/step_s"]


def measure(smoke: bool) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="mismatch-"))
    smol, demo_runs = {}, {}
    for dtype in ("float32", "bfloat16"):
        for exact in (True, False):
            smol[dtype, exact], _ = run_steps(single_turn(out, f"smol-{dtype}-{exact}", dtype, exact, smoke))
            demo_runs[dtype, exact], _ = run_steps(demo(out, f"demo-{dtype}-{exact}", dtype, exact, smoke))
    agent_a, samples_a = run_steps(agentic(out, "agent-a", smoke))
    agent_b, samples_b = run_steps(agentic(out, "agent-b", smoke))
    survives = {
        "fp32": sync_survival("float32", torch.float32, True, smoke)[0],
        "bf16": sync_survival("bf16_autocast", torch.bfloat16, True, smoke)[0],
    }
    default_bf16, visible = sync_survival("bf16_autocast", torch.bfloat16, False, smoke)
    ratios = {
        f"{model}_{dtype}": round(step_time(runs[dtype, True]) / step_time(runs[dtype, False]), 3)
        for model, runs in (("demo", demo_runs), ("smollm2", smol))
        for dtype in ("float32", "bfloat16")
    }
    return {
        "exact_mode": True,
        "max_abs_diff_fp32": largest(smol["float32", True]),
        "tokens_compared_fp32": counted(smol["float32", True]),
        "max_abs_diff_bf16": largest(smol["bfloat16", True]),
        "tokens_compared_bf16": counted(smol["bfloat16", True]),
        "default_max_abs_diff_fp32": largest(smol["float32", False]),
        "default_max_abs_diff_bf16": largest(smol["bfloat16", False]),
        "max_abs_diff_agentic": largest(agent_a),
        "tokens_compared_agentic": counted(agent_a),
        "tokens_compared": min(counted(smol["float32", True]), counted(smol["bfloat16", True]), counted(agent_a)),
        "demo_max_abs_diff_exact": max(largest(demo_runs[d, True]) for d in ("float32", "bfloat16")),
        "reproducible": samples_a == samples_b and untimed(agent_a) == untimed(agent_b),
        "update_survives_sync_fraction": {k: round(v, 6) for k, v in survives.items()},
        "default_update_survives_sync_fraction": {"bf16": round(default_bf16, 6)},
        "master_update_visible_bf16": visible,
        "lr": LR,
        "exact_step_time_ratio": ratios,
        "exact_step_time_ratio_max": max(ratios.values()),
        "step_s": {
            f"{model}_{dtype}_{'exact' if exact else 'default'}": round(step_time(runs[dtype, exact]), 2)
            for model, runs in (("demo", demo_runs), ("smollm2", smol))
            for dtype in ("float32", "bfloat16")
            for exact in (True, False)
        },
    }


def report(r: dict[str, Any]) -> None:
    print("engine logprob - trainer recomputation, largest |difference| over every sampled token of the run")
    print(f"{'path':<52}{'max |diff|':>12}{'tokens':>8}")
    rows = [
        ("exact, float32 engine and trainer", "max_abs_diff_fp32", "tokens_compared_fp32"),
        ("exact, bf16 engine, bf16 autocast trainer", "max_abs_diff_bf16", "tokens_compared_bf16"),
        ("exact, agent episodes, individually scheduled", "max_abs_diff_agentic", "tokens_compared_agentic"),
        ("default, float32", "default_max_abs_diff_fp32", "tokens_compared_fp32"),
        ("default, bf16 (the default on CPUs with fast bf16)", "default_max_abs_diff_bf16", "tokens_compared_bf16"),
    ]
    for label, key, count in rows:
        print(f"{label:<52}{r[key]:>12.3g}{r[count]:>8}")
    print(f"exact demo runs, largest |diff|: {r['demo_max_abs_diff_exact']:.3g}")
    print(f"same seed, same tokens and metrics (exact agent step, run twice): {r['reproducible']}")
    s, d = r["update_survives_sync_fraction"], r["default_update_survives_sync_fraction"]
    print(
        f"share of one step's change (lr {r['lr']}) the engine's copy carries: exact float32 {s['fp32']:.6f}, "
        f"exact bf16 {s['bf16']:.6f}, default bf16 {d['bf16']:.6f}; of the float32 master weights' change, "
        f"visible in bf16: {r['master_update_visible_bf16']:.3f}"
    )
    print(f"{'step time, s (last step)':<28}{'exact':>10}{'default':>10}{'ratio':>8}")
    for key, ratio in r["exact_step_time_ratio"].items():
        exact, default = r["step_s"][f"{key}_exact"], r["step_s"][f"{key}_default"]
        print(f"{key:<28}{exact:>10.2f}{default:>10.2f}{ratio:>8.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    add_smoke(parser)
    args = parser.parse_args()
    from real_task import missing

    if (why := missing()) is not None:
        skip(why, args.json)
        return 0
    result = measure(args.smoke)
    report(result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
