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


FRAGMENTED = """
import json, torch
from pathlib import Path
from postrl.models.host_memory import keep_freed_memory, return_freed_memory

def rss_mb():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

assert keep_freed_memory()
blocks = [torch.ones(4 * 2**20 // 4 + 64 * i) for i in range(200)]  # 800 MB of 4 MB blocks, from the heap
pin = torch.ones(1024)  # above them: the heap's top is not free, so free() alone cannot shrink it
del blocks
kept = rss_mb()
returned = return_freed_memory()
print(json.dumps([kept, rss_mb(), returned]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_blocks_are_returned_to_the_os():
    """What the train worker and the native engine do after each update and decode loop: blocks
    kept in the heap (keep_freed_memory) below a live one stay resident until trimmed."""
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], check=True, capture_output=True, text=True)
    kept, trimmed, returned = json.loads(out.stdout.strip().splitlines()[-1])
    assert returned
    assert kept - trimmed > 600, (kept, trimmed)
