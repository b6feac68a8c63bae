"""The design's worked example: a 70B model (Llama-3-70B's shape) generating 64 sequences of 8k
tokens at TP=8 in bf16, about 17.5 GB of weights and 21 GB of KV cache per GPU, and its
training model-state arithmetic (12 bytes per parameter, which leaves out the fp32 master weights)."""

from __future__ import annotations

from typing import Any

from postrl.run.plan.memory import MicroBatch, RolloutSetup, TrainSetup, rollout_memory, train_rank_memory
from postrl.run.plan.shape import shape_from_config

LLAMA_70B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
}
DESIGN_WEIGHTS_GB, DESIGN_KV_GB, DESIGN_STATE_BYTES = 17.5, 21.0, 12


def design_example(tolerance: float = 0.05) -> dict[str, Any]:
    """The planner's figures for the example, and whether they are within ``tolerance`` of the design's."""
    shape = shape_from_config(LLAMA_70B)
    engine = rollout_memory(shape, RolloutSetup(2, 64, 8192, 2048, 7168, transposed_head=False), tp=8)
    weights, kv = engine.items["weights"] / 1e9, engine.items["kv_cache"] / 1e9
    train = train_rank_memory(shape, TrainSetup(4, 2, True, MicroBatch(1, 1, 7168, 1024), True), fsdp=64)
    ok = abs(weights / DESIGN_WEIGHTS_GB - 1) <= tolerance and abs(kv / DESIGN_KV_GB - 1) <= tolerance
    return {
        "weights_gb": round(weights, 3),
        "kv_gb": round(kv, 3),
        "model_state_bytes_per_param": round(float(train.detail["model_state_bytes_per_param"]), 3),
        "design_model_state_bytes_per_param": DESIGN_STATE_BYTES,
        "ok": ok,
    }
