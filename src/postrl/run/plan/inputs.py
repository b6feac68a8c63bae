"""What a plan is made from: the devices, the efficiencies assumed, and the run's numbers resolved
as ``postrl train`` resolves them."""

from __future__ import annotations

from dataclasses import dataclass

from postrl.config.run import RunConfig
from postrl.run.plan.gpus import GpuSpec
from postrl.run.plan.memory import (
    RolloutSetup,
    TrainSetup,
    micro_batch,
)
from postrl.run.plan.shape import ModelShape

GB = 1e9
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Target:
    """The devices a plan is for: a GPU preset, or this machine's CPU (``accelerator`` False)."""

    gpu: GpuSpec
    usable_fraction: float = 0.92  # the CUDA context and the allocator's fragmentation take the rest
    accelerator: bool = True

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu.memory_bytes * self.usable_fraction)


@dataclass(frozen=True)
class Efficiency:
    """The fractions of the GPU's peak the time estimates assume."""

    train_mfu: float = 0.40  # training FLOPs at 40% of the dense bf16 rate
    prefill_mfu: float = 0.50
    decode_bandwidth: float = 0.60  # decode reads the weights and the KV cache at 60% of the bandwidth


@dataclass(frozen=True)
class RunShape:
    """The numbers of a run the plan uses, resolved as ``postrl train`` resolves them."""

    prompts: int
    n: int
    prompt_tokens: int
    response_tokens: int
    engine_bytes: int
    param_bytes: int
    act_bytes: int
    autocast: bool
    accelerator: bool
    lean_model: bool  # a model the lean forward runs (Llama, Qwen2, Mistral)
    sized_by: str = ""  # the fields that set the sequence length, for the messages

    @property
    def sequences(self) -> int:
        return self.prompts * self.n


def run_shape(config: RunConfig, shape: ModelShape, target: Target) -> RunShape:
    """``data.max_prompt_tokens`` unset is the context left after the response (as at a run's start);
    the dtypes are the run's numerics on the target (:meth:`postrl.models.numerics.Machine.planned`)."""
    from postrl.models.numerics import Machine, resolve_numerics

    context = shape.context or 512
    prompt = config.data.max_prompt_tokens or max(1, context - config.rollout.max_tokens)
    response = config.rollout.max_tokens
    sized_by = f"data.max_prompt_tokens={prompt} + rollout.max_tokens={response}"
    if config.agent is not None:  # an episode's sample is its first prompt and every turn after it
        prompt, response = agent_split(config.agent.max_context, config.data.max_prompt_tokens)
        sized_by = f"agent.max_context={config.agent.max_context}"
    numerics = resolve_numerics(config, Machine.planned(target.accelerator))
    engine_bytes = 2 if numerics.engine == "bfloat16" else 4
    param_bytes = 2 if config.model.dtype == "bfloat16" else 4
    autocast = numerics.autocast
    act_bytes = 2 if numerics.trainer == "bfloat16" else 4
    return RunShape(
        config.prompts_per_step,
        config.rollout.n,
        prompt,
        response,
        engine_bytes,
        param_bytes,
        act_bytes,
        autocast,
        target.accelerator,
        shape.model_type in ("llama", "qwen2", "mistral"),
        sized_by,
    )


def agent_split(max_context: int, max_prompt_tokens: int | None) -> tuple[int, int]:
    """An agent run's planned sample: ``max_context`` tokens, of which the first prompt is a quarter
    (or ``data.max_prompt_tokens`` when that is less) and the turns after it the rest. The group's
    prompt is computed once and its n episodes' turns n times, so a short prompt is the costly case."""
    prompt = min(max_prompt_tokens or max_context, max(1, max_context // 4))
    return prompt, max_context - prompt


def train_setup(
    config: RunConfig, run: RunShape, checkpointing: bool | None = None, token_budget: int | None = None
) -> TrainSetup:
    t, lora = config.train, config.model.lora
    micro = micro_batch(
        t.micro_batch_size, run.n, run.prompt_tokens, run.response_tokens, token_budget or t.micro_batch_tokens
    )
    attention = t.attention if t.attention != "auto" else ("sdpa" if run.accelerator else "eager")
    return TrainSetup(
        run.param_bytes,
        run.act_bytes,
        run.autocast,
        micro,
        config.model.gradient_checkpointing if checkpointing is None else checkpointing,
        lora.r if lora is not None else None,
        tuple(lora.target_modules) if lora is not None else (),
        lean=t.forward == "lean" and run.lean_model and not config.rollout.exact,  # exact: its own forward
        eager_attention=attention == "eager",
    )


def rollout_setup(config: RunConfig, run: RunShape, concurrency: int | None = None) -> RolloutSetup:
    r = config.rollout
    max_len = (
        r.vllm.max_model_len
        if r.backend == "vllm" and r.vllm.max_model_len
        else run.prompt_tokens + run.response_tokens
    )
    conc = concurrency or min(r.max_batch_size, run.sequences)
    prefill = min(r.native.max_prefill_tokens, run.prompts * run.prompt_tokens)
    return RolloutSetup(
        run.engine_bytes, conc, max_len, prefill, run.prompt_tokens, transposed_head=r.backend != "vllm"
    )
