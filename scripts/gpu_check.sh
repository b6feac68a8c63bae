#!/usr/bin/env bash
# The GPU check, for a borrowed single-GPU machine that has PyTorch and transformers but no network.
# Missing Python packages come from .wheelhouse/ (made beforehand by scripts/make_wheelhouse.sh and
# carried with the repository). In under 8 minutes: the `gpu` tests, the demo on CUDA, and the GPU
# benchmark (rollout tokens/s, seconds per GRPO step, training MFU against the bf16 matmul rate
# measured in the same run), and the planner's memory against torch.cuda.max_memory_allocated. Everything lands in $OUT (default gpu_out/); the summary is
# $OUT/gpu_check.json.
#
#   scripts/gpu_check.sh            (on the GPU machine, from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
DEPS=${DEPS:-/tmp/postrl-deps}
export PYTHONPATH="$PWD/src:$PWD:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

missing=$("$PYTHON" - <<'PY'
import importlib.util
for line in open("scripts/gpu_requirements.txt"):
    line = line.strip()
    if line and not line.startswith("#"):
        module, requirement = line.split("=", 1)
        if importlib.util.find_spec(module) is None:
            print(requirement)
PY
)
if [ -n "$missing" ]; then
    echo "installing from .wheelhouse: $(echo $missing | tr '\n' ' ')"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --find-links .wheelhouse --target "$DEPS" $missing \
        > "$OUT/pip.txt" 2>&1 || { echo "pip install from .wheelhouse failed (see $OUT/pip.txt)"; }
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PYTHON" -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0))" \
    > "$OUT/torch.txt" 2>&1

start=$(date +%s)
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py > "$OUT/pytest.txt" 2>&1
tests_rc=$?
tests_s=$(( $(date +%s) - start ))

start=$(date +%s)
timeout 180 "$PYTHON" -m postrl demo output_dir="$OUT/runs" train.device=cuda rollout.device=cuda \
    logging.progress_bar=false > "$OUT/demo.txt" 2>&1
demo_rc=$?
demo_s=$(( $(date +%s) - start ))

start=$(date +%s)
timeout 240 "$PYTHON" benchmarks/gpu_step.py --json > "$OUT/gpu_step.txt" 2>&1
bench_rc=$?
bench_s=$(( $(date +%s) - start ))

start=$(date +%s)
timeout 120 "$PYTHON" benchmarks/plan_accuracy.py --device cuda --quick --json > "$OUT/plan_accuracy.txt" 2>&1
plan_rc=$?
plan_s=$(( $(date +%s) - start ))

"$PYTHON" - "$OUT" "$tests_rc" "$tests_s" "$demo_rc" "$demo_s" "$bench_rc" "$bench_s" "$plan_rc" "$plan_s" <<'PY'
import json, re, sys
out, tests_rc, tests_s, demo_rc, demo_s, bench_rc, bench_s, plan_rc, plan_s = sys.argv[1:]
def tail_json(path):
    for line in reversed(open(path).read().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None
pytest_tail = open(f"{out}/pytest.txt").read().strip().splitlines()[-1:]
demo = open(f"{out}/demo.txt").read()
acc = re.search(r"held-out accuracy ([0-9.]+) -> ([0-9.]+) after (\d+) GRPO steps", demo)
summary = {
    "torch": open(f"{out}/torch.txt").read().strip(),
    "tests": {"rc": int(tests_rc), "seconds": int(tests_s), "summary": pytest_tail},
    "demo": {"rc": int(demo_rc), "seconds": int(demo_s),
             "acc_before": float(acc.group(1)) if acc else None, "acc_after": float(acc.group(2)) if acc else None},
    "benchmark": {"rc": int(bench_rc), "seconds": int(bench_s), "result": tail_json(f"{out}/gpu_step.txt")},
    "plan_accuracy": {"rc": int(plan_rc), "seconds": int(plan_s), "result": tail_json(f"{out}/plan_accuracy.txt")},
}
json.dump(summary, open(f"{out}/gpu_check.json", "w"), indent=1)
print(json.dumps(summary))
PY
