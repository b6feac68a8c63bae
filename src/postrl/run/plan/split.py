"""How long a step's phases take on a GPU, and the rollout:train split of the GPUs with the shortest step."""

from __future__ import annotations

import math
from typing import Any

from postrl.config.run import RunConfig
from postrl.run.plan.inputs import GB, Efficiency, RunShape, Target
from postrl.run.plan.shape import ModelShape


def step_seconds(
    config: RunConfig, shape: ModelShape, run: RunShape, target: Target, tp: int, concurrency: int, eff: Efficiency
) -> tuple[float, float]:
    """(generation seconds of one engine of ``tp`` GPUs, training seconds on one GPU) for one step."""
    g = target.gpu
    waves = math.ceil(run.sequences / max(1, concurrency))
    kv_read = (
        min(concurrency, run.sequences)
        * (run.prompt_tokens + run.response_tokens / 2)
        * shape.kv_bytes_per_token(run.engine_bytes, tp)
    )
    per_token = (shape.params * run.engine_bytes / tp + kv_read) / (g.bandwidth_gbs * GB * eff.decode_bandwidth)
    prefill = 2 * shape.params * run.prompts * run.prompt_tokens / (tp * g.bf16_tflops * 1e12 * eff.prefill_mfu)
    generate = waves * run.response_tokens * per_token + prefill
    tokens = run.prompts * (run.prompt_tokens + run.n * run.response_tokens) * config.train.epochs
    passes = 4 if config.model.lora is not None else 6  # forward, input gradients (, weight gradients): 2 each
    passes += 2 * (config.algorithm.needs_reference) + 2 * (config.algorithm.old_logprobs == "recompute")
    train = passes * shape.params * tokens / (g.bf16_tflops * 1e12 * eff.train_mfu)
    return generate, train


def gpu_split(config: RunConfig, gen_s: float, train_s: float, tp: int, fsdp: int, gpus: int) -> dict[str, Any]:
    """The rollout:train split of ``gpus`` with the shortest step: engines split the prompts, train
    ranks the tokens; a sync step waits for both phases in turn, an async one for the longer."""
    overlap = config.controller.mode == "async"
    best: tuple[float, int, int] | None = None
    for engines in range(1, gpus // tp + 1):
        for ranks in range(fsdp, gpus - engines * tp + 1):
            phases = (gen_s / engines, train_s / ranks)
            step = max(phases) if overlap else sum(phases)
            if best is None or step < best[0] - 1e-12:
                best = (step, engines, ranks)
    out: dict[str, Any] = {
        "gpus": gpus,
        "mode": config.controller.mode,
        "generate_s_one_engine": round(gen_s, 4),
        "train_s_one_gpu": round(train_s, 4),
    }
    if best is None:
        out["colocate"] = True
        out["why"] = f"{gpus} GPU(s) is less than one engine ({tp}) plus the training group ({fsdp}): share the GPUs"
        return out
    step, engines, ranks = best
    out.update(
        rollout_engines=engines,
        rollout_gpus=engines * tp,
        train_gpus=ranks,
        step_s=round(step, 4),
        generate_s=round(gen_s / engines, 4),
        train_s=round(train_s / ranks, 4),
    )
    return out
