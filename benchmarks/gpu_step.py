"""GRPO on one GPU with models of real shapes (random weights: throughput needs the shape, not the
weights): rollout tokens/s of the native engine, seconds per GRPO step (generate + train + sync),
and the training MFU against the bf16 matmul rate measured in the same run.

Shapes: SmolLM2-135M (30 layers, 576 hidden, 49152 vocabulary) and a ~1B Llama (16 layers,
2048 hidden, 8192 MLP, 32/8 heads). Workload per step: 64 prompts of 64 tokens x G=8 samples x 128
new tokens (EOS suppressed so every sample has the same length), one optimizer step over the 512
samples in micro-batches of 16, bf16 autocast with fp32 master weights. MFU counts 6 x parameters
x trained tokens (prompt + response) per second of the update.

    python benchmarks/gpu_step.py [--json] [--shapes smollm2-135m,llama-1b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _smoke import add_smoke

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),  # a smoke test of this script
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
}
PROMPTS, PROMPT_TOKENS, G, NEW_TOKENS, MICRO = 64, 64, 8, 128, 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_matmul_tflops(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """The rate this GPU reaches on a large bf16 matmul: the MFU's denominator, measured here."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def synthetic_tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` tokens ("t0", "t1", ...), built offline, for decoding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token="t0", eos_token="t1")


def build_model(shape: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, bos_token_id=2, eos_token_id=1, pad_token_id=0, **SHAPES[shape])
    with torch.device(device):
        return LlamaForCausalLM(config)


def measure(
    shape: str, device: torch.device, peak_tflops: float, prompts_n: int = PROMPTS, new_tokens: int = NEW_TOKENS
) -> dict:
    from postrl.config.run import AlgorithmConfig, RolloutConfig, TrainConfig
    from postrl.models.weights import dedupe_tied
    from postrl.rollout.factory import rollout_worker_for_model
    from postrl.train.worker import PolicyTrainer
    from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams

    model = build_model(shape, device)
    params = sum(p.numel() for p in model.parameters())
    tokenizer = synthetic_tokenizer(SHAPES[shape]["vocab_size"])
    engine = rollout_worker_for_model(
        RolloutConfig(backend="native", dtype="bfloat16", max_batch_size=prompts_n * G),
        model,
        tokenizer,
        "float32",
        seed=0,
    )
    engine.loop_state.eos = frozenset()  # every sample runs to NEW_TOKENS: the same work in every step
    trainer = PolicyTrainer(
        model,
        TrainConfig(lr=1e-6, mini_batch_size=prompts_n * G, micro_batch_size=MICRO, device=str(device)),
        AlgorithmConfig(),
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        Prompt("", torch.randint(3, SHAPES[shape]["vocab_size"], (PROMPT_TOKENS,), generator=gen).tolist())
        for _ in range(prompts_n)
    ]
    sp = SamplingParams(n=G, temperature=1.0, max_tokens=new_tokens)
    steps = []
    for step in range(3):  # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        rollouts = engine.generate(prompts, sp, step)
        sync(device)
        t1 = time.perf_counter()
        exps = [
            Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, float(i % 2) - 0.5, step, group_id=r.prompt_index)
            for i, r in enumerate(rollouts)
        ]
        batch = ExperienceBatch.from_experiences(exps, 0)
        trainer.update(batch)
        sync(device)
        t2 = time.perf_counter()
        engine.update_weights(dedupe_tied(trainer.policy_state()), step + 1)
        sync(device)
        t3 = time.perf_counter()
        tokens = sum(len(r.response_ids) for r in rollouts)
        trained = int(batch.attention_mask.sum())
        steps.append((t1 - t0, t2 - t1, t3 - t2, tokens, trained))
    timed = steps[1:]
    gen_s = sum(s[0] for s in timed) / len(timed)
    train_s = sum(s[1] for s in timed) / len(timed)
    sync_s = sum(s[2] for s in timed) / len(timed)
    tokens, trained = timed[-1][3], timed[-1][4]
    mfu = 6 * params * trained / train_s / (peak_tflops * 1e12)
    del engine, trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "params_m": round(params / 1e6, 1),
        "rollout_tokens_per_s": round(tokens / gen_s, 1),
        "generate_s": round(gen_s, 3),
        "train_s": round(train_s, 3),
        "sync_s": round(sync_s, 3),
        "s_per_grpo_step": round(gen_s + train_s + sync_s, 3),
        "train_tokens_per_s": round(trained / train_s, 1),
        "mfu": round(mfu, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--shapes", default="smollm2-135m,llama-1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:  # the tiny shape: on a CPU it runs the whole path (it is what a GPU run measures)
        args.shapes, args.prompts, args.new_tokens = "tiny", 4, 8
    device = torch.device(args.device)
    peak = bf16_matmul_tflops(device)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bf16_matmul_tflops": round(peak, 1),
        "shapes": {},
    }
    print(
        f"{'shape':14s} {'params M':>9s} {'rollout tok/s':>14s} {'s/step':>8s} {'gen s':>7s} {'train s':>8s} "
        f"{'sync s':>7s} {'MFU':>6s}"
    )
    for shape in args.shapes.split(","):
        r = measure(shape, device, peak, args.prompts, args.new_tokens)
        result["shapes"][shape] = r
        print(
            f"{shape:14s} {r['params_m']:>9.1f} {r['rollout_tokens_per_s']:>14.1f} {r['s_per_grpo_step']:>8.2f} "
            f"{r['generate_s']:>7.2f} {r['train_s']:>8.2f} {r['sync_s']:>7.2f} {r['mfu']:>6.1%}"
        )
    print(f"bf16 matmul rate measured: {peak:.1f} TFLOP/s on {result['device']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
