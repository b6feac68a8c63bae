"""Does `postrl demo` learn on this CPU, in time and memory?

Runs the demo (GRPO on 3-digit addition from the shipped model) and prints held-out accuracy
before and after, steps, wall time and peak RSS. Targets on 2 CPU cores: acc_before <= 0.5,
acc_after >= 0.85, wall_s <= 600, peak_rss_mb <= 4096.

    python benchmarks/demo_learning.py [--json] [dotted.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile

from _smoke import add_smoke

from postrl.run.demo import run_demo

TARGETS = {"acc_before": ("<=", 0.5), "acc_after": (">=", 0.85), "wall_s": ("<=", 600), "peak_rss_mb": ("<=", 4096)}


def peak_rss_mb() -> float:
    """Peak resident memory of this process and (separately) its largest child, in MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own + children


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("overrides", nargs="*")
    add_smoke(parser)
    args = parser.parse_args()
    smoke = ["steps=2", "prompts_per_step=8", "train.mini_batch_size=64", "train.micro_batch_size=64"]
    with tempfile.TemporaryDirectory() as out:
        result = run_demo(
            [f"output_dir={out}", "logging.progress_bar=false", *(smoke if args.smoke else []), *args.overrides],
            echo=lambda s: print(s, file=sys.stderr),
        )
    row = {
        "acc_before": round(result.acc_before, 4),
        "acc_after": round(result.acc_after, 4),
        "steps": result.steps,
        "wall_s": round(result.wall_s, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    print(f"{'metric':<12} {'value':>10} {'target':>10} {'ok':>4}")
    ok_all = True
    for key, value in row.items():
        op, target = TARGETS.get(key, ("", None))
        ok = target is None or (value <= target if op == "<=" else value >= target)
        ok_all &= ok
        print(
            f"{key:<12} {value:>10} {(op + str(target)) if target is not None else '':>10} {'yes' if ok else 'NO':>4}"
        )
    if args.json:
        print(json.dumps(row))
    return 0 if ok_all or args.smoke else 1  # two smoke steps learn nothing: the targets are not checked


if __name__ == "__main__":
    sys.exit(main())
