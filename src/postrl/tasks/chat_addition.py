"""Single-digit addition asked in plain English, for chat models (e.g. SmolLM2-135M-Instruct).

The answer is the last integer in the response, so a model is not required to use any tag:
``"3 + 4 = 7"`` scores 1. SmolLM2-135M-Instruct gets about a third right before training.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

_INT = re.compile(r"-?\d+")


def rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append(
            {
                "messages": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "answer": str(a + b),
                "task_type": "chat_addition",
            }
        )
    return out


def write_jsonl(path: str | Path, count: int, seed: int = 0) -> Path:
    """``count`` rows as JSONL at ``path`` (its folder made if missing), the same for the same seed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed)))
    return path


def score(prompt: str, response: str, answer: str = "", **_: object) -> float:
    """1.0 when the last integer in the response equals ``answer``."""
    found = _INT.findall(response)
    return 1.0 if found and int(found[-1]) == int(answer) else 0.0
