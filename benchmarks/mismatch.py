"""How far the engine's numbers are from the trainer's: logprobs, weights, reproducibility.

Issue 43, part 3 asks that the native engine's logprob of every sampled token equal the trainer's
recomputation bit for bit, in float32 and in bf16, through batch-invariant kernels on both sides
(``rollout.exact``). postrl has no such mode yet; this benchmark is the measurement that mode will
be held to, run on what there is today:

- ``max_abs_diff_fp32`` / ``max_abs_diff_bf16``: the largest |engine logprob - trainer logprob|
  over one GRPO step of SmolLM2-135M-Instruct on reasoning-gym sums (``rollout/logprob_diff_max``
  of the run, the trainer recomputing every sampled token): engine and trainer in float32, then a
  bf16 engine with bf16 autocast training (the default on CPUs with fast bf16, so also
  ``default_max_abs_diff_bf16``); ``max_abs_diff_agentic``: the same over an agent step of
  individually scheduled multi-turn episodes (the shipped ``agentic-demo`` model on the calculator
  environment, float32). ``tokens_compared_*``: the sampled tokens each covers.
- ``reproducible``: two runs of the agent step with the same seed give the same tokens, individually
  scheduled episodes included (each sample draws from its own random stream).
- ``update_survives_sync_fraction_fp32`` / ``_bf16``: one AdamW step (lr ``LR``) of SmolLM2 by the
  trainer, then the weights synced into a native engine of that dtype: the share of the change in
  the weights the trainer's forward computes with (after its casts: bf16 for autocast's matmuls,
  float32 for everything autocast leaves alone, the norms) that the engine's copy carries,
  ``1 - |dE - dT| / |dT|``; 1.0 when exact.
- ``master_update_visible_bf16``: of the float32 master weights' change in that step, the share
  that survives rounding to bf16 (``train/update_visible_bf16``).
- ``exact_step_time_ratio``: exact over default step time; null while there is no exact mode.

    python benchmarks/mismatch.py [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
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


def run_step(config: dict) -> tuple[dict[str, float], list[list[int]]]:
    """One ``postrl train`` step: its metrics and every sample's (prompt index, response) in order."""
    from postrl.config.loading import build_config
    from postrl.run.metrics import read_metrics
    from postrl.run.train_runner import train

    train(build_config(config))
    run = Path(config["output_dir"]) / config["name"]
    samples = [json.loads(line) for line in (run / "samples" / "step_1.jsonl").read_text().splitlines()]
    return read_metrics(run / "metrics.jsonl")[0], [[s["prompt_index"], s["response"]] for s in samples]


def single_turn(out: Path, name: str, rollout_dtype: str, precision: str, smoke: bool) -> dict:
    from postrl.models.gguf import smollm2_dir

    return {
        "name": name,
        "output_dir": str(out),
        "seed": 0,
        "steps": 1,
        "prompts_per_step": 2 if smoke else 12,
        "model": {"path": str(smollm2_dir())},
        "data": {"reasoning_gym": GYM, "max_prompt_tokens": 256},
        "rollout": {
            "n": 2 if smoke else 8,
            "max_tokens": 8 if smoke else 48,
            "temperature": 1.0,
            "dtype": rollout_dtype,
        },
        "reward": {"components": [{"name": "correct", "type": "reasoning_gym"}], "num_workers": 1},
        "algorithm": {"kl_beta": 0.0, "old_logprobs": "recompute"},
        "train": {
            "lr": LR,
            "precision": precision,
            "mini_batch_size": 4 if smoke else 96,
            "micro_batch_size": 4 if smoke else 16,
        },
        "checkpoint": {"every_steps": 0},
        "logging": {"trackers": ["jsonl"], "console": False, "progress_bar": False},
    }


def agentic(out: Path, name: str, smoke: bool) -> dict:
    return {
        "name": name,
        "output_dir": str(out),
        "seed": 0,
        "steps": 1,
        "prompts_per_step": 2 if smoke else 48,
        "model": {"path": "agentic-demo"},
        "data": {"task": "calculator"},
        "rollout": {"n": 2 if smoke else 4, "temperature": 1.0, "max_tokens": 40, "dtype": "float32"},
        "agent": {
            "env": "calculator",
            "max_turns": 3,
            "max_tokens_per_turn": 40,
            "max_context": 128,
            "tools_in_prompt": "none",
            "scheduling": "individual",
        },
        "algorithm": {"old_logprobs": "recompute"},
        "train": {
            "lr": 1e-4,
            "precision": "float32",
            "mini_batch_size": 4 if smoke else 192,
            "micro_batch_size": 4 if smoke else 32,
        },
        "checkpoint": {"every_steps": 0},
        "logging": {"trackers": ["jsonl"], "console": False, "progress_bar": False},
    }


def tokens(metrics: dict[str, float]) -> int:
    from postrl.types.metric_names import RESPONSE_LENGTH_MEAN, REWARD_SAMPLES

    return round(metrics[RESPONSE_LENGTH_MEAN] * metrics[REWARD_SAMPLES])


def sync_survival(precision: str, engine_dtype: torch.dtype, smoke: bool) -> tuple[float, float | None]:
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
    engine = NativeRolloutWorker.from_hf(model, tokenizer, engine_dtype)
    algorithm = AlgorithmConfig(kl_beta=0.0, old_logprobs="recompute", importance={"type": "none"})
    rows = 4 if smoke else 16
    train = TrainConfig(lr=LR, precision=precision, mini_batch_size=rows, micro_batch_size=rows)
    trainer = PolicyTrainer(model, train, algorithm, max_response_tokens=24, seed=0, proximal="recompute")
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
        and leaves the norms' in float32."""
        out = {}
        for name, p in model.named_parameters():
            w = p.detach().clone()
            out[name] = w.to(torch.bfloat16).float() if autocast and w.dim() == 2 else w
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


def measure(smoke: bool) -> dict[str, Any]:
    from postrl.types.metric_names import ROLLOUT_LOGPROB_DIFF_MAX

    out = Path(tempfile.mkdtemp(prefix="mismatch-"))
    fp32, _ = run_step(single_turn(out, "fp32", "float32", "float32", smoke))
    bf16, _ = run_step(single_turn(out, "bf16", "bfloat16", "bf16_autocast", smoke))
    agent_a, samples_a = run_step(agentic(out, "agent-a", smoke))
    _, samples_b = run_step(agentic(out, "agent-b", smoke))
    survives_fp32, _ = sync_survival("float32", torch.float32, smoke)
    survives_bf16, visible = sync_survival("bf16_autocast", torch.bfloat16, smoke)
    return {
        "exact_mode": False,
        "max_abs_diff_fp32": fp32[ROLLOUT_LOGPROB_DIFF_MAX],
        "tokens_compared_fp32": tokens(fp32),
        "max_abs_diff_bf16": bf16[ROLLOUT_LOGPROB_DIFF_MAX],
        "tokens_compared_bf16": tokens(bf16),
        "default_max_abs_diff_bf16": bf16[ROLLOUT_LOGPROB_DIFF_MAX],
        "max_abs_diff_agentic": agent_a[ROLLOUT_LOGPROB_DIFF_MAX],
        "tokens_compared_agentic": tokens(agent_a),
        "tokens_compared": min(tokens(fp32), tokens(bf16), tokens(agent_a)),
        "reproducible": samples_a == samples_b,
        "update_survives_sync_fraction": {"fp32": round(survives_fp32, 6), "bf16": round(survives_bf16, 6)},
        "master_update_visible_bf16": visible,
        "lr": LR,
        "exact_step_time_ratio": None,
    }


def report(r: dict[str, Any]) -> None:
    print("engine logprob - trainer recomputation, largest |difference| over every sampled token of one step")
    print(f"{'path':<44}{'max |diff|':>12}{'tokens':>8}")
    rows = [
        ("float32 engine, float32 trainer", "max_abs_diff_fp32", "tokens_compared_fp32"),
        ("bf16 engine, bf16 autocast trainer (default)", "max_abs_diff_bf16", "tokens_compared_bf16"),
        ("agent episodes, individually scheduled", "max_abs_diff_agentic", "tokens_compared_agentic"),
    ]
    for label, key, count in rows:
        print(f"{label:<44}{r[key]:>12.3g}{r[count]:>8}")
    print("exact mode (batch-invariant kernels): not built; exact_step_time_ratio: n/a")
    print(f"same seed, same tokens (individually scheduled agent step, run twice): {r['reproducible']}")
    s = r["update_survives_sync_fraction"]
    print(
        f"share of one step's change (lr {r['lr']}) the engine's copy carries: float32 {s['fp32']:.6f}, "
        f"bf16 {s['bf16']:.6f}; of the float32 master weights' change, visible in bf16: "
        f"{r['master_update_visible_bf16']:.3f}"
    )


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
