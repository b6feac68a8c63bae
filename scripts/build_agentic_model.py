"""Warm-start a tool-using model for the ``calculator`` task, from the shipped demo model.

A short supervised pass on whole episodes: in a fraction ``--p-tool`` of them the model calls
``calculator(expression="a*b")``, reads the tool's answer and copies it into
``<answer>..</answer>``; in the others it answers at once with a number that looks right and is
wrong (no small model multiplies 3-digit by 2-digit numbers in its head). The model so knows both
ways and starts near ``p-tool`` held-out success; RL on the environment's reward then has to
learn *when* to call the tool. Loss on the model's turns only (the tool's answer is read, never predicted).

Run: ``python scripts/build_agentic_model.py [--out DIR] [--steps N]``. Deterministic on CPU. By
default it writes the model the package ships as ``agentic-demo`` (``src/postrl/tasks/agentic_model``),
which ``examples/calculator_agent.yaml`` and ``benchmarks/agentic.py`` start from; 2,000 steps take
about 11 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_demo_model import DEFAULT_OUT, train  # noqa: E402

from postrl.models.loading import AGENTIC_MODEL_DIR  # noqa: E402
from postrl.rollout.agentic.chat import ChatRenderer  # noqa: E402
from postrl.tasks.calculator_task import problems  # noqa: E402
from postrl.tasks.char_tokenizer import build_char_tokenizer  # noqa: E402


def wrong(value: int, rng: random.Random) -> int:
    """A number with ``value``'s digit count that is not ``value``."""
    digits = list(str(value))
    i = rng.randrange(len(digits))
    digits[i] = str((int(digits[i]) + rng.randint(1, 9)) % 10) if i else str(rng.randint(1, 9))
    guess = int("".join(digits))
    return guess if guess != value else value + 1


def episode(renderer: ChatRenderer, a: int, b: int, use_tool: bool, rng: random.Random) -> list[tuple[list[int], bool]]:
    """An episode's token segments, each marked trained (the model's) or not."""
    messages = [{"role": "user", "content": f"{a}*{b}"}]
    seen = renderer.render(messages, generation_prompt=True)
    segments = [(renderer.encode(seen), False)]
    end = renderer.end_of_turn_ids()
    turns = (
        [f'calculator(expression="{a}*{b}")', f"<answer>{a * b}</answer>"]
        if use_tool
        else [f"<answer>{wrong(a * b, rng)}</answer>"]
    )
    for k, turn in enumerate(turns):
        ids = renderer.encode(turn) + end
        segments.append((ids, True))
        seen += renderer.decode(ids)
        if k + 1 < len(turns):
            messages += [{"role": "assistant", "content": turn}, {"role": "tool", "content": str(a * b)}]
            delta, seen = renderer.delta(seen, messages)
            assert delta.ids is not None
            segments.append((delta.ids, False))
    return segments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=AGENTIC_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--p-tool", type=float, default=0.45, help="fraction of SFT episodes that call the tool")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_OUT, attn_implementation="eager")  # CPU SDPA backward is slow
    renderer = ChatRenderer(tokenizer)
    rng = random.Random(args.seed)
    train_pairs, _ = problems(seed=0)
    examples = []
    for a, b in train_pairs:
        segments = episode(renderer, a, b, rng.random() < args.p_tool, rng)
        ids = [t for seg, _ in segments for t in seg]
        mask = [int(trained) for seg, trained in segments for _ in seg]
        examples.append((ids, mask))
    train(model, tokenizer.pad_token_id, examples, args.steps, args.batch_size, args.lr, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
