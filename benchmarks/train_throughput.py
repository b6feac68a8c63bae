"""Training forward+backward throughput on SmolLM2-135M at the GRPO step's shapes, against the
bf16 matmul rate measured in the same run.

One micro-batch is 2 groups of a 40-token prompt and G=8 responses of 64 tokens (the samples of a
group share their prompt forward), bf16 autocast, fp32 weights, entropy computed as the trainer
does. Each round times the lean forward (``train.forward: lean``) and the transformers forward
once each, alternating, so that a slow phase of the shared machine hits both; the matmul rate is
measured between rounds on the step's largest projection shape. FLOPs per micro-batch: 6 x the
non-embedding parameters x tokens, plus 6 x the output projection x response tokens, plus the
attention scores each forward really needs (4 x head_dim x heads x the score entries, x3 for the
backward).

Then the LoRA logprob gaps: SmolLM2 with r=16 adapters (B random), synced to the native engine
as adapters (applied unmerged) or merged, fp32 and bf16 engines, against the fp32 trainer.

    python benchmarks/train_throughput.py [--json] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _smoke import add_smoke, skip

PROMPT, RESPONSE, G, GROUPS = 40, 64, 8, 2


def micro_batch(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(GROUPS):
        prompt = torch.randint(0, 49000, (PROMPT,), generator=gen)
        rows += [torch.cat([prompt, torch.randint(0, 49000, (RESPONSE,), generator=gen)]) for _ in range(G)]
    ids = torch.stack(rows)
    target = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    target[:, PROMPT - 1 :] = 1
    return ids, torch.ones_like(ids), target, torch.arange(len(rows)) // G


def step_flops(config) -> float:
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv, d, inter = config.num_key_value_heads, h // heads, config.intermediate_size
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * inter
    tokens = GROUPS * (PROMPT + G * RESPONSE)
    responses = GROUPS * G * RESPONSE
    scores = GROUPS * (PROMPT * (PROMPT + 1) / 2 + G * (RESPONSE * PROMPT + RESPONSE * (RESPONSE + 1) / 2))
    attention = 3 * 4 * d * heads * scores * layers
    return 6 * per_layer * layers * tokens + 6 * h * config.vocab_size * responses + attention


def matmul_rate() -> float:
    """bf16 TFLOP/s of the step's MLP projection shape (tokens x hidden -> intermediate)."""
    a = torch.randn(GROUPS * (PROMPT + G * RESPONSE), 576, dtype=torch.bfloat16)
    b = torch.randn(1536, 576, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b.t()
    count, start = 40, time.perf_counter()
    for _ in range(count):
        a @ b.t()
    return 2 * a.shape[0] * 576 * 1536 * count / (time.perf_counter() - start) / 1e12


def time_micro_batch(model, batch, lean: bool) -> float:
    from postrl.train.logprobs import token_logprobs

    ids, attention, target, groups = batch
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs(model, ids, attention, 1.0, "value", target_mask=target, group_ids=groups, lean=lean)
    (logp.sum() / target.sum()).backward()
    return time.perf_counter() - start


def lora_gaps(model_dir: str, tokenizer) -> dict[str, float]:
    """Engine vs trainer logprobs of the same samples with LoRA r=16 adapters (B drawn at random, as
    after training): adapters synced alone and applied unmerged, and merged, in fp32 and bf16."""
    from postrl.config.run import LoraConfig
    from postrl.models.loading import load_causal_lm
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.train.logprobs import token_logprobs
    from postrl.train.lora import adapter_state, apply_lora, merged_state
    from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams

    torch.manual_seed(0)
    base = load_causal_lm(model_dir)
    policy = apply_lora(load_causal_lm(model_dir), LoraConfig(r=16, alpha=32.0))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.02)
    texts = [f"What is {a} + {b}?" for a, b in zip(range(11, 27), range(40, 56))]
    prompts = [Prompt(t, tokenizer(t)["input_ids"]) for t in texts]
    gaps = {}
    for dtype, sync in (("float32", "adapter"), ("float32", "merged"), ("bfloat16", "adapter"), ("bfloat16", "merged")):
        engine = NativeRolloutWorker.from_hf(base, tokenizer, dtype=getattr(torch, dtype), seed=1)
        engine.update_weights(adapter_state(policy) if sync == "adapter" else merged_state(policy), 1)
        rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=32), 1)
        exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 0) for r in rollouts]
        batch = ExperienceBatch.from_experiences(exps, tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(policy, batch.input_ids, batch.attention_mask, target_mask=batch.response_mask)
        gaps[f"{dtype}_{sync}"] = float(((logp - batch.old_logprobs) * batch.response_mask).abs().max())
    return gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    add_smoke(parser)
    args = parser.parse_args()

    from postrl.models.gguf import smollm2_dir, smollm2_gguf_path

    if args.smoke:
        args.rounds = 1
        try:
            smollm2_gguf_path()
        except FileNotFoundError as exc:
            skip(str(exc), args.json)
            return 0
    from postrl.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(str(smollm2_dir())).train()
    model.set_attn_implementation("eager")
    flops = step_flops(model.config)
    tokens = GROUPS * (PROMPT + G * RESPONSE)
    times: dict[str, list[float]] = {"lean": [], "transformers": []}
    rates = [matmul_rate()]
    for lean in (True, False):  # warm-up
        time_micro_batch(model, micro_batch(0), lean)
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for lean in order:
            times["lean" if lean else "transformers"].append(time_micro_batch(model, micro_batch(r + 1), lean))
        rates.append(matmul_rate())
    ceiling = statistics.median(rates)
    lean_s, hf_s = statistics.median(times["lean"]), statistics.median(times["transformers"])
    print(
        f"SmolLM2-135M forward+backward, {GROUPS} groups x (prompt {PROMPT} + {G} x {RESPONSE}) = {tokens} tokens, "
        f"bf16 autocast, {torch.get_num_threads()} threads, {args.rounds} alternating rounds (median)"
    )
    print(f"bf16 matmul ceiling: {ceiling:.3f} TFLOP/s (rounds: {[round(x, 3) for x in rates]})")
    print(f"{'forward':<14}{'s/micro':>9}{'tokens/s':>10}{'TFLOP/s':>9}{'of ceiling':>12}")
    for name, s in (("lean", lean_s), ("transformers", hf_s)):
        print(f"{name:<14}{s:>9.3f}{tokens / s:>10.0f}{flops / s / 1e12:>9.3f}{flops / s / 1e12 / ceiling:>12.3f}")
    print(f"lean vs transformers: {hf_s / lean_s:.2f}x; per-round seconds: {times}")
    from postrl.models.loading import load_tokenizer

    gaps = lora_gaps(str(smollm2_dir()), load_tokenizer(str(smollm2_dir())))
    print("LoRA r=16, engine vs trainer (fp32 trainer), max |logprob diff| over 32 x 32 sampled tokens:")
    for key, gap in gaps.items():
        print(f"  engine {key.replace('_', ', sync ')}: {gap:.2e}")
    if args.json:
        row = {
            "train_tokens_per_s": round(tokens / lean_s, 1),
            "train_tflops": round(flops / lean_s / 1e12, 4),
            "matmul_tflops": round(ceiling, 4),
            "train_ceiling_fraction": round(flops / lean_s / 1e12 / ceiling, 4),
            "transformers_ceiling_fraction": round(flops / hf_s / 1e12 / ceiling, 4),
            "lean_vs_transformers": round(hf_s / lean_s, 3),
            "lora_logprob_gap": gaps["float32_adapter"],
            "lora_merged_gap_fp32": gaps["float32_merged"],
            "lora_adapter_gap_bf16": gaps["bfloat16_adapter"],
            "lora_merged_gap_bf16": gaps["bfloat16_merged"],
        }
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
