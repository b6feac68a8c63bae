"""Gemma 3, the second real model family, on a tiny model built from its config: what it does that
the Llama/Qwen family does not (embeddings scaled by sqrt(hidden), RMSNorm weights as 1 + w, q/k
norms, sliding-window layers with their own RoPE base, GELU-tanh MLPs, pre/post-feedforward norms)
is the transformers model's, which the rollout falls back to (the native engine runs Llama/Qwen2/
Mistral) and the trainer runs whole (its head is not applied apart): two GRPO steps, and the
engine's logprobs equal the trainer's in float32."""

from __future__ import annotations

import json

import pytest
import torch

from postrl.config.loading import build_config
from postrl.run.train_runner import train


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, char_tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(char_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        sliding_window=8,  # shorter than the prompts: the local layers' window matters
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=char_tokenizer.bos_token_id,
        eos_token_id=char_tokenizer.eos_token_id,
        pad_token_id=char_tokenizer.pad_token_id,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # random norms, so that 1 + w differs from w: a Llama-style norm would be wrong
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp("tiny_gemma3")
    model.save_pretrained(out)
    char_tokenizer.save_pretrained(out)
    return out


def test_a_tiny_gemma3_trains_with_engine_logprobs_equal_to_the_trainers(tmp_path, tiny_gemma3_dir, arithmetic_jsonl):
    from postrl.models.loading import load_causal_lm

    config = build_config({
        "name": "gemma3", "output_dir": str(tmp_path), "steps": 2, "prompts_per_step": 4,
        "model": {"path": str(tiny_gemma3_dir)},
        "data": {"train_files": [str(arithmetic_jsonl)]},
        "rollout": {"n": 4, "max_tokens": 8, "dtype": "float32"},
        "reward": {"components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:length_score"}]},
        "train": {"lr": 1e-2, "mini_batch_size": 16, "micro_batch_size": 8},
        "logging": {"trackers": ["jsonl"]},
    })  # fmt: skip
    controller = train(config).controller
    assert controller.step_count == 2
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    before = load_causal_lm(str(tiny_gemma3_dir)).state_dict()
    after = load_causal_lm(str(config.run_dir / "final_model")).state_dict()
    assert (
        after["model.layers.0.self_attn.q_norm.weight"].shape == before["model.layers.0.self_attn.q_norm.weight"].shape
    )
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2  # trained: most tensors moved
    assert load_causal_lm(str(config.run_dir / "final_model")).config.model_type == "gemma3_text"
