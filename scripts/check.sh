#!/usr/bin/env bash
# The static checks every change passes before the tests: ruff (lint and format) over the code, mypy over src/.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/ruff format --check src tests benchmarks scripts
.venv/bin/mypy
