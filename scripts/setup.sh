#!/usr/bin/env bash
# Create .venv (once) and install postrl with its test extras. Safe to run again: it only
# installs what is missing. torch is installed first, pinned to the local CPU build, so that no
# dependency pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet "torch==2.13.0"
fi
.venv/bin/pip install --quiet -e ".[test]"
