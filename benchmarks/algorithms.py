"""Every on-policy algorithm of the library on the demo task, from the shipped model, same budget.

Each entry is the demo config (3-digit addition, 32 prompts x 8 samples, 100 steps, lr 1e-4) with
its advantage estimator, policy loss and loss aggregation; the table gives the held-out accuracy
of the final model (200 test problems, greedy), the steps and the wall time. Target: >= 0.80 for
every entry but plain `reinforce`, within 3 minutes each on 2 cores.

    python benchmarks/algorithms.py [--json] [--only grpo,rloo] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

ALGORITHMS: dict[str, list[str]] = {
    "grpo": ["algorithm.advantage=grpo", "algorithm.policy_loss=ppo_clip"],
    "dr_grpo": ["algorithm.advantage=dr_grpo", "algorithm.loss_agg=seq_mean_token_sum_norm"],
    "rloo": ["algorithm.advantage=rloo"],
    "remax": ["algorithm.advantage=remax"],
    "ppo": ["algorithm.advantage={type: gae, gamma: 1.0, lam: 0.95}",
            "algorithm.critic={lr: 1.0e-3, micro_batch_size: 128}"],
    "reinforce_pp": ["algorithm.advantage=reinforce_pp"],
    "reinforce_pp_baseline": ["algorithm.advantage=reinforce_pp_baseline"],
    "gspo": ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq_mean_token_mean"],
    "cispo": ["algorithm.policy_loss=cispo"],
    "clip_higher": ["algorithm.policy_loss={type: ppo_clip, clip_eps_high: 0.28}"],
    "reinforce": ["algorithm.advantage=dr_grpo", "algorithm.policy_loss=reinforce"],
    "dapo": ["algorithm.policy_loss={type: ppo_clip, clip_eps_high: 0.28}", "algorithm.dynamic_sampling=true",
             "reward.components=[{name: correct, type: exact_match}, "
             "{name: overlong, type: overlong, max_tokens: 16, cache_tokens: 4}]"],
}
TARGET_ACC, BUDGET_S = 0.80, 180.0


def run(name: str, steps: int, out: str) -> dict:
    from postrl.demo import run_demo

    overrides = [f"output_dir={out}", f"name={name}", f"steps={steps}", "logging.progress_bar=false",
                 "logging.console=false", "logging.tensorboard=false", *ALGORITHMS[name]]
    result = run_demo(overrides, echo=lambda s: print(f"[{name}] {s}", file=sys.stderr))
    return {"acc": round(result.acc_after, 4), "acc_before": round(result.acc_before, 4), "steps": result.steps,
            "wall_s": round(result.wall_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default=",".join(ALGORITHMS))
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for name in args.only.split(","):
            results[name] = run(name, args.steps, out)
    print(f"{'algorithm':24s} {'acc':>6s} {'steps':>6s} {'wall s':>7s}  target")
    for name, r in results.items():
        target = "-" if name == "reinforce" else f">= {TARGET_ACC}, <= {BUDGET_S:.0f} s"
        ok = name == "reinforce" or (r["acc"] >= TARGET_ACC and r["wall_s"] <= BUDGET_S)
        print(f"{name:24s} {r['acc']:>6.3f} {r['steps']:>6d} {r['wall_s']:>7.1f}  {target} {'yes' if ok else 'NO'}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
