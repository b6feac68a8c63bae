"""Seconds per GRPO step on the demo task, this source tree against another, in interleaved runs.

Each run is `postrl train` of the demo config (3-digit addition from the shipped model, 32 prompts
x 8 samples, 16 new tokens) for ``--steps`` steps in a fresh process whose ``PYTHONPATH`` is one of
the trees; the first step (warm-up) is dropped and the run's median ``time/step_s`` kept. Runs
alternate between the trees (``--rounds`` each) so that a machine whose speed drifts affects both
alike. The table gives each run, each tree's median over its runs, and the ratio this/baseline.

    python benchmarks/step_time.py --baseline-src /path/to/old/checkout/src [--rounds 4] [--steps 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _smoke import add_smoke

HERE = Path(__file__).resolve().parents[1] / "src"
RUN = """
import json, sys
try:  # this layout
    from postrl.config.loading import build_config
    from postrl.run.demo import DEMO_SETTINGS
    from postrl.run.train_runner import train
except ImportError:  # the layout before the pipeline issue (0.2.0)
    from postrl.config import build_config
    from postrl.demo import DEMO_SETTINGS
    from postrl.runner import train
settings = dict(DEMO_SETTINGS, name="timed", output_dir=sys.argv[1], steps=int(sys.argv[2]))
settings["logging"] = {"console": False, "trackers": ["jsonl"], "progress_bar": False}
train(build_config(settings))
rows = [json.loads(line) for line in open(sys.argv[1] + "/timed/metrics.jsonl")]
print(json.dumps([r["time/step_s"] for r in rows]))
"""


def one_run(src: Path, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": str(src), "RAY_AUTH_MODE": "disabled"}
        done = subprocess.run(
            [sys.executable, "-c", RUN, out, str(steps)], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"run with {src} failed:\n{done.stderr[-3000:]}")
        times = json.loads(done.stdout.strip().splitlines()[-1])
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", help="the src/ folder of the tree to compare against (required)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:  # this tree against itself, one round of 2 steps
        args.baseline_src, args.rounds, args.steps = args.baseline_src or str(HERE), 1, 2
    if args.baseline_src is None:
        parser.error("--baseline-src is required")
    trees = {"this": HERE, "baseline": Path(args.baseline_src).resolve()}
    runs: dict[str, list[float]] = {name: [] for name in trees}
    print(f"{'round':>5}  {'tree':<9} {'median step (s)':>16}")
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(one_run(trees[name], args.steps))
            print(f"{r + 1:>5}  {name:<9} {runs[name][-1]:>16.3f}", flush=True)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    ratio = medians["this"] / medians["baseline"]
    spread = {name: (min(v), max(v)) for name, v in runs.items()}
    print(
        f"\nmedian step: this {medians['this']:.3f} s, baseline {medians['baseline']:.3f} s, this/baseline {ratio:.3f}"
    )
    print(
        f"range: this {spread['this'][0]:.3f}-{spread['this'][1]:.3f} s, baseline {spread['baseline'][0]:.3f}-{spread['baseline'][1]:.3f} s"
    )
    if args.json:
        print(json.dumps({"this_s": medians["this"], "baseline_s": medians["baseline"], "ratio": ratio, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
