"""Two trainable policies in one episode: a chain of two additions.

Each row is ``a+b+c`` (3-digit numbers). The policy ``first`` is asked ``a+b=`` and answers
``<answer>x</answer>``; the policy ``second`` is asked ``x+c=`` on the first's answer. Each is
rewarded for its own step (``first``: x == a+b; ``second``: its sum of what it was given), so each
learns its own role; the episode's team accuracy (both right) is logged too. Both start from the
shipped demo model, served with a plain template (the model was trained on bare ``347+285=``
prompts, not chat turns): :func:`make_model` writes that folder.

Run it (``benchmarks/multi_policy.py`` does all of this and measures it)::

    .venv/bin/python examples/agents/arithmetic_chain.py runs/chain      # model folder and data
    .venv/bin/postrl train examples/agents/two_policies.yaml
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
from pathlib import Path

import openai

PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the demo's own prompts: BOS, then the text
)
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def answer_in(text: str) -> int | None:
    found = ANSWER.search(text)
    return int(found.group(1)) if found else None


def _ask(client: openai.OpenAI, policy: str, prompt: str) -> str:
    reply = client.chat.completions.create(
        model=policy, messages=[{"role": "user", "content": prompt}], temperature=1.0, max_tokens=16
    )
    return reply.choices[0].message.content or ""


def chain(client: openai.OpenAI, row: dict) -> dict[str, float]:
    """One episode: ``first`` adds a and b, ``second`` adds c to the first's answer (when it gave one)."""
    a, b, c = int(row["a"]), int(row["b"]), int(row["c"])
    x = answer_in(_ask(client, "first", f"{a}+{b}="))
    if x is None:
        return {"first": 0.0}  # the second never acts: it has no sample in this episode
    y = answer_in(_ask(client, "second", f"{x}+{c}="))
    return {"first": float(x == a + b), "second": float(y == x + c)}


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, c = (rng.randint(100, 999) for _ in range(3))
        out.append({"prompt": f"{a}+{b}+{c}", "a": a, "b": b, "c": c, "answer": str(a + b + c), "task_type": "chain"})
    return out


def write_data(folder: Path, train: int = 4000, held_out: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """Train and held-out rows, disjoint (held-out problems never appear in train)."""
    folder.mkdir(parents=True, exist_ok=True)
    test = rows(held_out, seed + 10_000)  # its own stream, whatever the train seed
    seen = {r["prompt"] for r in test}
    paths = []
    for name, data in (
        ("train", [r for r in rows(train + held_out, seed) if r["prompt"] not in seen][:train]),
        ("held_out", test),
    ):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        paths.append(path)
    return paths[0], paths[1]


def make_model(folder: Path) -> Path:
    """The shipped demo model with a plain chat template: a chat call's prompt is its message's text."""
    from postrl.models.loading import DEMO_MODEL_DIR

    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(DEMO_MODEL_DIR, folder)
    (folder / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/chain")
    print(make_model(out / "model"), *write_data(out / "data"))
