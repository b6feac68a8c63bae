"""The peak-memory figure of a phase: it sees what the phase allocated, and is reset for the next."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each test runs torch in a subprocess

PHASES = """
import json, torch
from postrl.train.memory import PeakMemory

cpu = torch.device("cpu")
with PeakMemory(cpu) as quiet:
    pass
with PeakMemory(cpu) as busy:
    block = torch.ones(300 * 2**20 // 4)  # 300 MB, touched
    del block
with PeakMemory(cpu) as after:
    pass
print(json.dumps([quiet.mb, busy.mb, after.mb]))
"""


def test_cpu_peak_counts_the_phase_and_resets_for_the_next():
    """In a fresh process: a long test session's heap may already hold freed pages that a new block
    reuses without growing the resident set."""
    out = subprocess.run([sys.executable, "-c", PHASES], check=True, capture_output=True, text=True)
    quiet, busy, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert busy - quiet > 250
    assert after < busy - 250  # the high-water mark was reset when the phase started


def test_train_update_reports_its_peak(tiny_model_dir, char_tokenizer):
    from postrl.config.run import AlgorithmConfig, TrainConfig
    from postrl.models.loading import load_causal_lm
    from postrl.train.worker import PolicyTrainer
    from tests.test_fsdp import uneven_batch

    worker = PolicyTrainer(
        load_causal_lm(str(tiny_model_dir)), TrainConfig(mini_batch_size=12, micro_batch_size=4), AlgorithmConfig()
    )
    metrics = worker.update(uneven_batch(char_tokenizer.pad_token_id))
    assert 50 < metrics.get("memory/train_peak_mb") < 8000
