"""Sync against async (one-step-off) GRPO on the demo task, with a verifier that takes realistic time.

Every run is ``postrl train`` of the demo config (3-digit addition from the shipped model, 32
prompts x 8 samples, 16 new tokens) in a fresh process, the same seed for all; the reward service
waits ``--verifier-delay`` seconds per batch before scoring, as a remote sandbox would. The held-out
accuracy of each final model is measured greedily on the task's 200 test problems.

Modes:
  (default)       sync and async (controller.mode=async, buffer.max_staleness=1; the proximal policy
                  approximated, and recomputed): wall time, ratio, accuracy, the largest lag seen, and
                  each phase's median seconds per step.
  --mismatch      sync runs with the engine in bf16 and the trainer in fp32: the engine's logprobs
                  used directly (old_logprobs=rollout) against recompute + TIS; their mismatch KL.
  --kv-ablation   async runs where weights arrive mid-generation, the prefix KV cache kept or
                  recomputed: held-out accuracy every 10 steps, wall time, mismatch KL; a PNG.
  --few-cores     the demo, the calculator agent and the single-turn SmolLM2 step, each sync and
                  async (overlap auto and generation), no verifier delay: async must never be slower
                  (``<case>_async_over_sync`` <= 1.0); ``--load`` keeps one core busy throughout.

    python benchmarks/async_overlap.py [--steps 60] [--rounds 2] [--verifier-delay 0.3] [--json]
    python benchmarks/async_overlap.py --mismatch [--steps 100] [--json]
    python benchmarks/async_overlap.py --kv-ablation [--steps 60] [--png docs/async_kv_ablation.png] [--json]
    python benchmarks/async_overlap.py --few-cores [--cases demo agent single_turn] [--load] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from _smoke import add_smoke

EXTRA_OVERRIDES: list[str] = []  # every run's, after its own (--smoke: the tiny sizes)
SMOKE_OVERRIDES = ["prompts_per_step=4", "rollout.n=4", "train.mini_batch_size=16", "train.micro_batch_size=16"]
PHASES = ("generate", "reward", "train", "sync", "wait", "weight_push", "produce", "step")


class SlowVerifier:
    """A Reward Service that waits ``delay`` seconds per batch, then scores with ``inner``."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.accuracy_component = inner.accuracy_component

    def score(self, prompt, response, **columns):
        from postrl.types import ScoreRequest

        return self.score_batch([ScoreRequest(prompt, response, columns)])[0]

    def score_batch(self, requests):
        time.sleep(self.delay)
        return self.inner.score_batch(requests)

    def set_log_file(self, path) -> None:
        self.inner.set_log_file(path)

    def error_count(self) -> int:
        return self.inner.error_count()

    def close(self) -> None:
        self.inner.close()


def run_one(spec: dict) -> dict:
    """One training run in this process (``--one``): its wall time, accuracy and per-step metrics.
    The wall time is ``postrl train``'s from the config to the final model and plot, with the
    libraries already imported (a process's one-time imports, ~4 s, are the same in every mode
    and no part of a run)."""
    import matplotlib.pyplot  # noqa: F401 - imported before the clock starts (see above)
    import transformers.models.llama.modeling_llama  # noqa: F401

    from postrl.config.loading import build_config
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.run import train_runner
    from postrl.run.demo import DEMO_SETTINGS
    from postrl.run.evaluate import evaluate_model

    if spec["delay"]:
        make = train_runner.make_reward_service
        train_runner.make_reward_service = lambda config: SlowVerifier(make(config), spec["delay"])
    base = spec.get("settings", DEMO_SETTINGS)
    settings = dict(base, name=spec["name"], output_dir=spec["out"], steps=spec["steps"], seed=spec["seed"])
    settings["logging"] = {"console": False, "trackers": ["jsonl"], "progress_bar": False, **spec.get("logging", {})}
    config = build_config(settings, spec["overrides"])
    began = time.perf_counter()
    train_runner.train(config)
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in open(config.run_dir / "metrics.jsonl")]
    if not spec.get("evaluate", True):
        return {"wall_s": wall, "acc": float("nan"), "rows": rows}
    tokenizer = load_tokenizer(config.model.path)
    final = evaluate_model(load_causal_lm(str(config.run_dir / "final_model")), tokenizer, "arithmetic")
    return {"wall_s": wall, "acc": final.accuracy, "rows": rows}


def launch(name: str, out: str, steps: int, seed: int, delay: float, overrides: list[str], **extra) -> dict:
    overrides = [*overrides, *EXTRA_OVERRIDES]
    spec = {"name": name, "out": out, "steps": steps, "seed": seed, "delay": delay, "overrides": overrides, **extra}
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    done = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(rows: list[dict]) -> dict[str, float]:
    """Median seconds per phase over the steps after the first (warm-up)."""
    out = {}
    for phase in PHASES:
        values = [r[f"time/{phase}_s"] for r in rows[1:] if f"time/{phase}_s" in r]
        if values:
            out[phase] = statistics.median(values)
    return out


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and r[key] == r[key]]
    return sum(values) / len(values) if values else float("nan")


ASYNC = ["controller.mode=async", "buffer.max_staleness=1"]
OVERLAP_MODES = {  # name: (overrides, what the table calls it)
    "sync": ([], "sync"),
    "async": ([*ASYNC, "algorithm.old_logprobs=approximate"], "async, proximal approximated (A-3PO)"),
    "async_recompute": (ASYNC, "async, proximal recomputed (default)"),
}


def overlap(args: argparse.Namespace, out: str) -> dict:
    """``--rounds`` rounds of a sync run and the two async runs (the proximal policy approximated,
    as A-3PO does, or recomputed by a forward pass, the default), the order rotating between rounds
    so that a machine whose speed drifts affects all alike."""
    delay, names = args.verifier_delay, list(OVERLAP_MODES)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(launch(f"{name}{r}", out, args.steps, args.seed, delay, OVERLAP_MODES[name][0]))
    print(f"{args.steps} steps, verifier waits {delay * 1000:.0f} ms per batch, {args.rounds} rounds")
    print(f"{'run':<42}{'wall s':>9}{'loop s':>9}{'held-out acc':>14}{'max lag':>9}   median s per step by phase")
    for name in names:
        for i, run in enumerate(runs[name]):
            lag = max((r.get("buffer/lag_max", 0.0) for r in run["rows"]), default=0.0)
            where = "  ".join(f"{k} {v:.3f}" for k, v in medians(run["rows"]).items())
            label = f"{OVERLAP_MODES[name][1]} #{i + 1}"
            print(f"{label:<42}{run['wall_s']:>9.1f}{loop_s(run):>9.1f}{run['acc']:>14.3f}{lag:>9.0f}   {where}")
    wall = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    loop = {name: statistics.median(loop_s(r) for r in rs) for name, rs in runs.items()}
    acc = {name: statistics.median(r["acc"] for r in rs) for name, rs in runs.items()}
    lag_seen = max(r.get("buffer/lag_max", 0.0) for name in names[1:] for run in runs[name] for r in run["rows"])
    for name in names[1:]:
        print(f"{OVERLAP_MODES[name][1]} / sync, medians: wall {wall[name] / wall['sync']:.3f}, "
              f"steps alone {loop[name] / loop['sync']:.3f}")  # fmt: skip
    return {
        "steps": args.steps,
        "rounds": args.rounds,
        "verifier_delay_s": delay,
        "sync_wall_s": round(wall["sync"], 2),
        "async_wall_s": round(wall["async"], 2),
        "ratio": round(wall["async"] / wall["sync"], 3),
        "ratio_steps": round(loop["async"] / loop["sync"], 3),
        "async_recompute_wall_s": round(wall["async_recompute"], 2),
        "ratio_recompute": round(wall["async_recompute"] / wall["sync"], 3),
        "sync_acc": acc["sync"],
        "async_acc": acc["async"],
        "async_recompute_acc": acc["async_recompute"],
        "max_lag_seen": lag_seen,
        "phases_s": {name: {k: round(v, 3) for k, v in medians(runs[name][0]["rows"]).items()} for name in names},
    }


FEW_CORE_MODES = {  # name: overrides; each case's async runs, against its sync run
    "sync": [],
    "async": ASYNC,  # controller.overlap: auto
    "async_generation": [*ASYNC, "controller.overlap=generation"],
}


def few_core_cases(out: str) -> dict[str, tuple[dict, int]]:
    """The three configs of issue 44's C3, each ``(settings, steps)``: the demo; the calculator agent
    (its episodes scheduled individually, which overlap: generation needs); the single-turn
    SmolLM2-135M step of examples/smollm2_grpo.yaml (bf16 on a CPU with AMX)."""
    import yaml

    from postrl.run.demo import DEMO_SETTINGS
    from postrl.tasks.chat_addition import write_jsonl

    root = Path(__file__).resolve().parents[1]
    agent = yaml.safe_load((root / "examples" / "calculator_agent.yaml").read_text())
    agent["agent"]["scheduling"] = "individual"
    agent["logging"] = {}
    agent["checkpoint"] = {"every_steps": 0}
    smollm2 = yaml.safe_load((root / "examples" / "smollm2_grpo.yaml").read_text())
    smollm2["model"]["path"] = str(Path(smollm2["model"]["path"]).expanduser())
    smollm2["data"]["train_files"] = [str(write_jsonl(Path(out) / "addition.jsonl", 512))]
    smollm2["checkpoint"] = {"every_steps": 0}
    return {"demo": (dict(DEMO_SETTINGS), 30), "agent": (agent, 12), "single_turn": (smollm2, 4)}


class BusyCore:
    """A process that keeps one core busy (``--load``): a user's other work on a laptop or a shared node."""

    def __enter__(self) -> BusyCore:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def few_cores(args: argparse.Namespace, out: str) -> dict:
    """Each case's sync run against its async runs (overlap auto and generation), ``--rounds`` rounds
    with the order rotating; the ratio of the median walls. ``<case>_async_over_sync`` is the
    slower async run's: an async run must never be slower than the sync run of its config."""
    cases = few_core_cases(out)
    chosen = args.cases or list(cases)
    result: dict = {"rounds": args.rounds, "load": args.load, "cases": {}}
    print(f"sync against async on {os.cpu_count()} cores, {args.rounds} rounds"
          + (", a busy process on one core" if args.load else ", quiet"))  # fmt: skip
    print(f"{'case':<13}{'mode':<18}{'steps':>6}{'wall s':>9}{'range':>12}{'/ sync':>8}   median s per step by phase")
    for case in chosen:
        settings, steps = cases[case]
        steps = args.steps or steps
        runs: dict[str, list[dict]] = {m: [] for m in FEW_CORE_MODES}
        names = list(FEW_CORE_MODES)
        with BusyCore() if args.load else nullcontext():
            for r in range(args.rounds):
                for mode in names[r % len(names) :] + names[: r % len(names)]:
                    runs[mode].append(launch(f"{case}_{mode}{r}", out, steps, args.seed, 0.0,
                                             FEW_CORE_MODES[mode], settings=settings, evaluate=False))  # fmt: skip
        wall = {m: statistics.median(r["wall_s"] for r in rs) for m, rs in runs.items()}
        for mode in names:
            where = "  ".join(f"{k} {v:.3f}" for k, v in medians(runs[mode][0]["rows"]).items())
            walls = [r["wall_s"] for r in runs[mode]]
            spread = f"{min(walls):.1f}-{max(walls):.1f}"
            print(
                f"{case:<13}{mode:<18}{steps:>6}{wall[mode]:>9.1f}{spread:>12}{wall[mode] / wall['sync']:>8.3f}   {where}"
            )
        ratios = {m: round(wall[m] / wall["sync"], 3) for m in names[1:]}
        result["cases"][case] = {
            "steps": steps,
            "wall_s": {m: round(w, 2) for m, w in wall.items()},
            "walls_s": {m: [round(r["wall_s"], 2) for r in rs] for m, rs in runs.items()},
            "ratios": ratios,
        }
        result[f"{case}_async_over_sync"] = max(ratios.values())
    return result


def loop_s(run: dict) -> float:
    """The steps' own seconds (each step's time/step_s summed): the wall time less start and end."""
    return sum(r["time/step_s"] for r in run["rows"] if "time/step_s" in r)


def mismatch(args: argparse.Namespace, out: str) -> dict:
    common = ["rollout.dtype=bfloat16", "train.precision=float32"]
    rollout_lp = launch("rollout_lp", out, args.steps, args.seed, 0.0, [*common, "algorithm.old_logprobs=rollout"])
    tis = launch("recompute_tis", out, args.steps, args.seed, 0.0, [*common, "algorithm.old_logprobs=recompute"])
    kl = mean_of(tis["rows"], "rollout/mismatch_kl")
    print(f"{args.steps} steps each, engine bf16, trainer fp32")
    print(f"{'old logprobs':<22}{'held-out acc':>14}{'wall s':>9}{'mismatch KL':>14}{'logprob diff max':>18}")
    for name, run in (("rollout (engine's)", rollout_lp), ("recompute + TIS", tis)):
        diff = max(r.get("rollout/logprob_diff_max", 0.0) for r in run["rows"])
        print(
            f"{name:<22}{run['acc']:>14.3f}{run['wall_s']:>9.1f}{mean_of(run['rows'], 'rollout/mismatch_kl'):>14.5f}{diff:>18.3f}"
        )
    return {
        "steps": args.steps,
        "rollout_lp_acc": rollout_lp["acc"],
        "recompute_tis_acc": tis["acc"],
        "mismatch_kl": kl,
        "rollout_lp_wall_s": round(rollout_lp["wall_s"], 2),
        "recompute_tis_wall_s": round(tis["wall_s"], 2),
        "is_rejected_fraction": mean_of(tis["rows"], "rollout/is_rejected_fraction"),
    }


def kv_ablation(args: argparse.Namespace, out: str) -> dict:
    base = ["controller.mode=async", f"buffer.max_staleness={args.staleness}", "data.val_size=200"]
    logging = {"eval_every": 10}
    runs = {
        policy: launch(
            f"kv_{policy}",
            out,
            args.steps,
            args.seed,
            args.verifier_delay,
            [*base, f"rollout.kv_after_update={policy}"],
            logging=logging,
        )  # fmt: skip
        for policy in ("keep", "recompute")
    }
    curves = {
        p: [(r["step"], r["val/accuracy"]) for r in run["rows"] if "val/accuracy" in r] for p, run in runs.items()
    }
    print(f"{args.steps} steps, async, max_staleness {args.staleness}, verifier {args.verifier_delay * 1000:.0f} ms")
    print(
        f"{'kv_after_update':<18}{'final acc':>10}{'wall s':>9}{'mismatch KL':>13}{'partial rollouts':>17}   val acc every 10 steps"
    )
    for policy, run in runs.items():
        mid = int(sum(r.get("rollout/partial_rollouts", 0.0) for r in run["rows"]))
        curve = " ".join(f"{acc:.2f}" for _, acc in curves[policy])
        kl = mean_of(run["rows"], "rollout/mismatch_kl")
        print(f"{policy:<18}{run['acc']:>10.3f}{run['wall_s']:>9.1f}{kl:>13.5f}{mid:>17}   {curve}")
    if args.png:
        plot_curves(curves, Path(args.png), args)
        print(f"plot: {args.png}")
    return {
        "steps": args.steps,
        "keep_acc": runs["keep"]["acc"],
        "recompute_acc": runs["recompute"]["acc"],
        "keep_wall_s": round(runs["keep"]["wall_s"], 2),
        "recompute_wall_s": round(runs["recompute"]["wall_s"], 2),
        "keep_mismatch_kl": mean_of(runs["keep"]["rows"], "rollout/mismatch_kl"),
        "recompute_mismatch_kl": mean_of(runs["recompute"]["rows"], "rollout/mismatch_kl"),
        "keep_curve": curves["keep"],
        "recompute_curve": curves["recompute"],
    }


def plot_curves(curves: dict, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, points in curves.items():
        ax.plot([s for s, _ in points], [a for _, a in points], marker="o", label=f"kv_after_update={policy}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (200 problems)")
    ax.set_title(f"async GRPO, max_staleness {args.staleness}: stale KV cache kept or recomputed")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 60; --mismatch 100)")
    parser.add_argument("--verifier-delay", type=float, default=0.3, help="seconds the verifier waits per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="sync/async rounds (default mode)")
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--kv-ablation", action="store_true")
    parser.add_argument("--few-cores", action="store_true", help="sync against async of the demo, an agent, SmolLM2")
    parser.add_argument("--cases", nargs="*", default=None, help="--few-cores: which of demo, agent, single_turn")
    parser.add_argument("--load", action="store_true", help="--few-cores: a busy process on one core throughout")
    parser.add_argument("--staleness", type=int, default=2, help="--kv-ablation: buffer.max_staleness")
    parser.add_argument("--png", default=None, help="--kv-ablation: where to write the learning curves")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    add_smoke(parser)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.smoke:
        args.steps, args.rounds, args.verifier_delay = 2, 1, 0.05
        EXTRA_OVERRIDES.extend(SMOKE_OVERRIDES)
    if args.steps is None and not args.few_cores:
        args.steps = 100 if args.mismatch else 60
    with tempfile.TemporaryDirectory(prefix="postrl-async-bench-") as out:
        if args.mismatch:
            result = mismatch(args, out)
        elif args.kv_ablation:
            result = kv_ablation(args, out)
        elif args.few_cores:
            result = few_cores(args, out)
        else:
            result = overlap(args, out)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
