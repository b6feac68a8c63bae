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
# Debian's prometheus, for the test where a real Prometheus server scrapes a run (skipped, saying
# why, where it cannot be installed: not root, or no apt)
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } \
        || echo "note: could not install Debian's prometheus; its test will be skipped"
fi
