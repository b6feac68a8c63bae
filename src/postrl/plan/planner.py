"""``postrl plan``: the memory of every role of a run per GPU, the sizes that fit, and a GPU split.

Everything is read from the run config and the models' ``config.json`` files; no weights are
loaded. The figures are the memory model's (:mod:`postrl.plan.memory`); the time estimates take
the GPU's dense bf16 rate and memory bandwidth at the efficiencies stated in :class:`Efficiency`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from postrl.config.run import RunConfig
from postrl.plan.gpus import GpuSpec
from postrl.plan.memory import (
    MicroBatch,
    RoleMemory,
    RolloutSetup,
    TrainSetup,
    frozen_model_memory,
    micro_batch,
    rollout_memory,
    train_rank_memory,
)
from postrl.plan.shape import ModelShape, load_shape

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


@dataclass
class Problem:
    """A role that does not fit, with the changes that would make it fit."""

    role: str
    needed_bytes: int
    available_bytes: int
    fixes: list[str]

    def message(self) -> str:
        return (
            f"{self.role} needs {self.needed_bytes / GB:.2f} GB per GPU, more than the "
            f"{self.available_bytes / GB:.2f} GB usable; " + "; or ".join(self.fixes)
        )


@dataclass
class Plan:
    model: str
    params: int
    target: Target
    roles: list[RoleMemory]
    rollout_tp: int | None
    rollout_max_concurrency: int | None
    train_fsdp: int | None
    split: dict[str, Any]
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def role(self, name: str) -> RoleMemory:
        return next(r for r in self.roles if r.role == name)

    def to_dict(self) -> dict[str, Any]:
        g = self.target.gpu
        return {
            "model": self.model,
            "params": self.params,
            "gpu": {
                "name": g.name,
                "memory_gb": g.memory_gb,
                "bf16_tflops": g.bf16_tflops,
                "bandwidth_gbs": g.bandwidth_gbs,
            },
            "usable_gb_per_gpu": round(self.target.usable_bytes / GB, 3),
            "roles": [
                {
                    "role": r.role,
                    "ranks": r.ranks,
                    "total_gb": round(r.total / GB, 4),
                    "items_gb": {k: round(v / GB, 4) for k, v in r.items.items()},
                    "detail": r.detail,
                }
                for r in self.roles
            ],
            "rollout_tp": self.rollout_tp,
            "rollout_max_concurrency": self.rollout_max_concurrency,
            "train_fsdp": self.train_fsdp,
            "split": self.split,
            "fits": self.fits,
            "problems": [
                {"role": p.role, "needed_gb": round(p.needed_bytes / GB, 3), "fixes": p.fixes, "message": p.message()}
                for p in self.problems
            ],
            "notes": self.notes,
        }


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

    @property
    def sequences(self) -> int:
        return self.prompts * self.n


def run_shape(config: RunConfig, shape: ModelShape, target: Target) -> RunShape:
    """``data.max_prompt_tokens`` unset is the context left after the response (as at a run's start);
    dtypes ``auto`` are bf16 on a GPU with bf16 and on a CPU with fast bf16."""
    import torch

    from postrl.rollout.factory import bf16_is_fast

    context = shape.context or 512
    prompt = config.data.max_prompt_tokens or max(1, context - config.rollout.max_tokens)
    fast_bf16 = target.accelerator or bf16_is_fast(torch.device("cpu"))
    engine = config.rollout.dtype or config.model.dtype
    engine_bytes = 2 if engine == "bfloat16" or (engine == "auto" and fast_bf16) else 4
    param_bytes = 2 if config.model.dtype == "bfloat16" else 4
    precision = config.train.precision
    autocast = precision == "bf16_autocast" or (precision == "auto" and target.accelerator)
    act_bytes = 2 if autocast or param_bytes == 2 else 4
    return RunShape(
        config.prompts_per_step,
        config.rollout.n,
        prompt,
        config.rollout.max_tokens,
        engine_bytes,
        param_bytes,
        act_bytes,
        autocast,
    )


def train_setup(
    config: RunConfig, run: RunShape, checkpointing: bool | None = None, token_budget: int | None = None
) -> TrainSetup:
    t, lora = config.train, config.model.lora
    micro = micro_batch(
        t.micro_batch_size, run.n, run.prompt_tokens, run.response_tokens, token_budget or t.micro_batch_tokens
    )
    return TrainSetup(
        run.param_bytes,
        run.act_bytes,
        run.autocast,
        micro,
        config.model.gradient_checkpointing if checkpointing is None else checkpointing,
        lora.r if lora is not None else None,
        tuple(lora.target_modules) if lora is not None else (),
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


def _sizes(limit: int, divides: int | None = None) -> list[int]:
    return [s for s in SIZES if s <= limit and (divides is None or divides % s == 0)]


def fit_rollout(shape: ModelShape, setup: RolloutSetup, usable: int, limit: int) -> tuple[int | None, RoleMemory]:
    """The smallest tensor-parallel size (a divisor of the heads, at most ``limit``) that fits."""
    sizes = _sizes(limit, shape.heads) or [1]
    for tp in sizes:
        memory = rollout_memory(shape, setup, tp)
        if memory.total <= usable:
            return tp, memory
    return None, rollout_memory(shape, setup, sizes[-1])


def max_concurrency(shape: ModelShape, setup: RolloutSetup, usable: int, tp: int) -> int:
    """The most sequences of ``setup.max_len`` whose KV cache fits beside the weights and the work."""
    per_sequence = setup.max_len * shape.kv_bytes_per_token(setup.dtype_bytes, tp)
    base = rollout_memory(shape, replace(setup, concurrency=1), tp)
    count = max(0, (usable - base.total) // per_sequence + 1)
    while count > 0 and rollout_memory(shape, replace(setup, concurrency=count), tp).total > usable:
        count -= 1
    return int(count)


def fit_train(shape: ModelShape, setup: TrainSetup, usable: int, limit: int) -> tuple[int | None, RoleMemory]:
    """The smallest FSDP size (at most ``limit`` ranks) whose rank fits."""
    sizes = _sizes(limit) or [1]
    for f in sizes:
        memory = train_rank_memory(shape, setup, f)
        if memory.total <= usable:
            return f, memory
    return None, train_rank_memory(shape, setup, sizes[-1])


def train_fixes(config: RunConfig, shape: ModelShape, run: RunShape, usable: int, limit: int) -> list[str]:
    """The changes that would make a train rank fit, each checked with the memory model."""
    base = train_setup(config, run)
    fixes = []
    more, _ = fit_train(shape, base, usable, SIZES[-1])
    if more is not None and more > limit:
        fixes.append(f"train on {more} GPUs (scheduler.train.workers={more})")
    ranks = min(limit, SIZES[-1])
    if not base.checkpointing:
        ckpt = replace(base, checkpointing=True)
        if fit_train(shape, ckpt, usable, ranks)[0] is not None:
            fixes.append("model.gradient_checkpointing=true (activations kept per layer: its input only)")
    if base.lora_rank is None:
        lora = replace(
            base,
            lora_rank=16,
            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        )
        fit = fit_train(shape, lora, usable, ranks)[0]
        if fit is not None:
            fixes.append(f"model.lora.r=16 (gradients and optimizer state for the adapters only; fits on {fit} GPU(s))")
    budget = largest_token_budget(config, shape, run, usable, ranks)
    if budget is not None:
        fixes.append(f"train.micro_batch_tokens={budget} (fewer tokens per forward/backward)")
    return fixes or ["a GPU with more memory: no setting of this run fits"]


def largest_token_budget(config: RunConfig, shape: ModelShape, run: RunShape, usable: int, ranks: int) -> int | None:
    """The largest ``train.micro_batch_tokens`` (down to one prompt and one response) that fits."""
    low = run.prompt_tokens + run.response_tokens
    high = run.prompt_tokens + run.n * run.response_tokens * max(1, config.train.micro_batch_size // run.n)
    if fit_train(shape, train_setup(config, run, token_budget=low), usable, ranks)[0] is None:
        return None
    while high - low > max(1, low // 64):
        mid = (low + high) // 2
        fits = fit_train(shape, train_setup(config, run, token_budget=mid), usable, ranks)[0] is not None
        low, high = (mid, high) if fits else (low, mid)
    return low


def rollout_fixes(shape: ModelShape, setup: RolloutSetup, usable: int, limit: int) -> list[str]:
    fixes = []
    tp, _ = fit_rollout(shape, setup, usable, SIZES[-1])
    if tp is not None and tp > limit:
        fixes.append(f"a tensor-parallel size of {tp} (more GPUs per engine)")
    widest = (_sizes(limit, shape.heads) or [1])[-1]
    most = max_concurrency(shape, setup, usable, widest)
    if most >= 1:
        fixes.append(f"rollout.max_batch_size={most} (fewer sequences' KV cache at once)")
    return fixes or ["a GPU with more memory: the weights alone do not fit"]


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


def make_plan(config: RunConfig, target: Target, gpus: int | None = None, eff: Efficiency = Efficiency()) -> Plan:
    """The plan of ``config`` on ``gpus`` GPUs of ``target`` (None: as many as it takes)."""
    shape = load_shape(config.model.path)
    run = run_shape(config, shape, target)
    limit, usable = gpus or SIZES[-1], target.usable_bytes
    plan = Plan(config.model.path, shape.params, target, [], None, None, None, {})
    if config.rollout.backend == "openai":
        plan.notes.append("rollout.backend=openai: the rollout servers run elsewhere and are not planned here")
    else:
        plan_rollout(plan, config, shape, run, limit)
    setup = train_setup(config, run)
    plan.train_fsdp, memory = fit_train(shape, setup, usable, limit)
    plan.roles.append(memory)
    if plan.train_fsdp is None:
        plan.problems.append(Problem(memory.role, memory.total, usable, train_fixes(config, shape, run, usable, limit)))
    for role in side_roles(config, shape, run, setup.micro, memory.ranks):
        plan.roles.append(role)
        if role.total > usable:
            plan.problems.append(Problem(role.role, role.total, usable, [f"more GPUs for the {role.role}"]))
    tp, concurrency = plan.rollout_tp or 1, plan.rollout_max_concurrency or 1
    gen_s, train_s = step_seconds(
        config, shape, run, target, tp, min(concurrency, rollout_setup(config, run).concurrency), eff
    )
    plan.split = gpu_split(config, gen_s, train_s, tp, plan.train_fsdp or 1, gpus or 8)
    plan.split["efficiency"] = {
        "train_mfu": eff.train_mfu,
        "prefill_mfu": eff.prefill_mfu,
        "decode_bandwidth": eff.decode_bandwidth,
    }
    if run.param_bytes == 4:
        plan.notes.append(
            "float32 parameters are the master weights: 4 (weights) + 4 (gradients) + 8 (AdamW) = 16 bytes per "
            "parameter, as with bf16 weights and gradients and separate fp32 masters (2 + 2 + 4 + 8)"
        )
    return plan


def plan_rollout(plan: Plan, config: RunConfig, shape: ModelShape, run: RunShape, limit: int) -> None:
    """The engine's smallest tensor-parallel size and its largest KV concurrency (vLLM: within its
    share of the GPU)."""
    usable = plan.target.usable_bytes
    if config.rollout.backend == "vllm":
        usable = int(plan.target.gpu.memory_bytes * config.rollout.vllm.memory_fraction)
        plan.notes.append(
            f"vLLM may use rollout.vllm.memory_fraction={config.rollout.vllm.memory_fraction} of each GPU"
        )
    setup = rollout_setup(config, run)
    plan.rollout_tp, memory = fit_rollout(shape, setup, usable, limit)
    plan.rollout_max_concurrency = max_concurrency(shape, setup, usable, memory.ranks)
    memory.detail["max_concurrency"] = plan.rollout_max_concurrency
    plan.roles.append(memory)
    if plan.rollout_tp is None:
        plan.problems.append(Problem(memory.role, memory.total, usable, rollout_fixes(shape, setup, usable, limit)))


def side_roles(config: RunConfig, shape: ModelShape, run: RunShape, micro: MicroBatch, ranks: int) -> list[RoleMemory]:
    """The reference model (sharded like the policy), the critic and reward models, when the run has them."""
    roles = []
    if config.algorithm.needs_reference and config.model.lora is None:
        roles.append(frozen_model_memory(shape, run.param_bytes, micro, run.act_bytes, "reference model", ranks))
    critic = config.algorithm.critic
    if critic is not None:
        critic_shape = load_shape(critic.path) if critic.path else shape
        setup = TrainSetup(
            run.param_bytes,
            run.act_bytes,
            run.autocast,
            micro_batch(critic.micro_batch_size, run.n, run.prompt_tokens, run.response_tokens),
            config.model.gradient_checkpointing,
        )
        roles.append(train_rank_memory(critic_shape, setup, ranks, role="critic"))
    for component in config.reward.components:
        if component.type == "reward_model":
            rm_shape = load_shape(component.path)
            rm_micro = micro_batch(component.batch_size, 1, run.prompt_tokens + run.response_tokens, 0)
            roles.append(frozen_model_memory(rm_shape, 4, rm_micro, 4, f"reward model {component.name}"))
    return roles
