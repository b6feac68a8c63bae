"""Build the demo model shipped in ``src/postrl/tasks/demo_model``.

1. A character-level tokenizer made with the ``tokenizers`` library (digits, ASCII, the
   ``<answer>`` tags as single tokens, a ChatML-like chat template).
2. A small Llama-architecture model from ``transformers``, random init from a seed.
3. A short supervised warm start on the arithmetic task in which most carries are dropped
   (``347+285=`` -> ``<answer>522</answer>`` instead of ``632``): the model learns the answer
   format and how to add column by column, but is usually wrong when a carry is needed. GRPO
   with the verifiable reward then has something real to teach.

Run: ``python scripts/build_demo_model.py [--out DIR] [--steps N]``. Deterministic on CPU.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from postrl.tasks.arithmetic import make_splits
from postrl.tasks.char_tokenizer import build_char_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "postrl" / "tasks" / "demo_model"


def build_model(vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def sft_examples(tokenizer, problems, p_drop: float, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(token ids, 1 on the tokens trained) per problem: the loss is on the answer and its EOS."""
    out = []
    for p in problems:
        shown = p.carry_dropped_answer() if rng.random() < p_drop else p.answer
        prompt_ids = tokenizer(p.prompt)["input_ids"]
        response_ids = tokenizer(f"<answer>{shown}</answer>", add_special_tokens=False)["input_ids"]
        ids = prompt_ids + response_ids + [tokenizer.eos_token_id]
        out.append((ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))))
    return out


def train(
    model, pad_id: int, examples: list[tuple[list[int], list[int]]], steps: int, batch_size: int, lr: float, seed: int
) -> None:
    """Next-token loss on the tokens whose mask is 1, AdamW with a one-cycle schedule."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    start = time.time()
    for step in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=gen).tolist()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), pad_id)
        labels = torch.full((batch_size, width), -100)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step:5d} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--p-drop", type=float, default=0.8, help="fraction of SFT answers with carries dropped")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_char_tokenizer()
    model = build_model(len(tokenizer), tokenizer)
    train_problems, _ = make_splits(seed=args.seed, n_train=20000, n_test=200)
    examples = sft_examples(tokenizer, train_problems, args.p_drop, random.Random(args.seed))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    train(model, tokenizer.pad_token_id, examples, args.steps, args.batch_size, args.lr, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
