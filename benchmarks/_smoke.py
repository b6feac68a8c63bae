"""What every benchmark's ``--smoke`` mode shares: tiny sizes that run in seconds through the same
code path and print the same JSON keys, so that ``tests/test_benchmarks.py`` notices a benchmark
that no longer runs. A benchmark that needs what this machine lacks (TRL, vLLM, a GPU) says so and
prints ``{"skipped": reason}``; the test reports it as skipped, never as passed."""

from __future__ import annotations

import argparse
import json

SMOKE_HELP = "tiny sizes that run in seconds: the same code path and JSON keys (tests/test_benchmarks.py)"


def add_smoke(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def skip(reason: str, as_json: bool) -> None:
    """Say why the benchmark cannot run here, as a line and (with --json) as the last line."""
    print(f"skipped: {reason}")
    if as_json:
        print(json.dumps({"skipped": reason}))
