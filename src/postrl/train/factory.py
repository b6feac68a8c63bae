"""The one place a policy trainer is built: the policy, the reference model when a KL needs one,
and the optimizer (inside the Train Worker). Every scheduler calls it: the local one in this
process, each rank of an FSDP2 group in its own, each Ray actor in its."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from postrl.config.algorithm import AlgorithmConfig, ProximalSource
from postrl.config.run import LoraConfig, RunConfig, TrainConfig, exact_dtype_message
from postrl.models.devices import bf16_matmul_supported, resolve_device
from postrl.rollout.factory import bf16_is_fast
from postrl.train.worker import PolicyTrainer


@dataclass(frozen=True)
class PolicySpec:
    """What a trainer builds: the policy from ``model_path`` and how it is trained."""

    model_path: str
    model_dtype: str
    train: TrainConfig
    algorithm: AlgorithmConfig
    temperature: float
    seed: int
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = None
    max_response_tokens: int = 64  # rollout.max_tokens: Dr. GRPO's constant normaliser
    proximal: ProximalSource = "rollout"  # algorithm.old_logprobs, resolved by old_logprobs_source

    @staticmethod
    def of_run(config: RunConfig) -> PolicySpec:
        """The policy of a ``postrl train`` run."""
        check_exact_dtypes(config)
        return PolicySpec(
            config.model.path,
            config.model.dtype,
            config.train,
            config.algorithm,
            temperature=config.rollout.temperature,
            seed=config.seed,
            gradient_checkpointing=config.model.gradient_checkpointing,
            lora=config.model.lora,
            max_response_tokens=config.rollout.max_tokens,
            proximal=old_logprobs_source(config),
        )


def compute_dtypes(config: RunConfig) -> tuple[str, str]:
    """(the engine's dtype, the trainer's matmul dtype) as this machine resolves ``auto``: the rollout
    factory's rule for ``rollout.dtype`` (bf16 where bf16 is fast), the Train Worker's for
    ``train.precision`` (bf16 autocast on a GPU with bf16); bf16 parameters compute in bf16."""
    dtype = config.rollout.dtype or config.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if bf16_is_fast(resolve_device(config.rollout.device, "rollout.device")) else "float32"
    precision = config.train.precision
    if precision == "auto":
        device = resolve_device(config.train.device, "train.device")
        precision = "bf16_autocast" if bf16_matmul_supported(device) else "float32"
    bf16 = precision == "bf16_autocast" or config.model.dtype == "bfloat16"
    return dtype, "bfloat16" if bf16 else "float32"


def check_exact_dtypes(config: RunConfig) -> None:
    """rollout.exact with ``auto`` dtypes: they must resolve to one dtype on this machine (the config
    itself refuses an explicit mismatch)."""
    if not config.rollout.exact:
        return
    engine, trainer = compute_dtypes(config)
    if engine != trainer:
        dtype = config.rollout.dtype or config.model.dtype
        raise ValueError(exact_dtype_message(dtype, config.train.precision, engine, trainer))


def old_logprobs_source(config: RunConfig) -> ProximalSource:
    """``algorithm.old_logprobs`` resolved. ``auto``: where the engine computes like the trainer
    (rollout.exact, bit for bit in any dtype; or a native or hf engine in float32 on the trainer's
    device, with a float32 trainer), ``rollout`` for a sync on-policy run (the engine's logprobs
    are the trainer's own) and ``approximate`` otherwise (the only gap is then the weight version,
    which is what A-3PO models, without the proximal forward that would make an async run slower
    than sync where the two share the cores); ``recompute`` wherever the numerics differ."""
    choice = config.algorithm.old_logprobs
    if choice != "auto":
        return choice
    r, t = config.rollout, config.train
    gpu = torch.cuda.is_available()
    engine_fp32 = r.backend in ("auto", "native", "hf") and (r.dtype or config.model.dtype) == "float32"
    trainer_fp32 = t.precision == "float32" or (t.precision == "auto" and not (gpu and t.device != "cpu"))
    same_device = r.device == t.device or not gpu
    alike = r.exact or (engine_fp32 and trainer_fp32 and same_device)
    if not alike:
        return "recompute"
    return "rollout" if config.on_policy else "approximate"


def build_train_worker(spec: PolicySpec, device: torch.device, world: int = 1) -> PolicyTrainer:
    """A Train Worker on ``device``; with ``world > 1`` one rank of an FSDP2 group (the default
    process group must be initialised), whose forward and backward run in bf16 when the train
    precision asks for it."""
    from postrl.models.loading import load_causal_lm

    policy = load_causal_lm(spec.model_path, spec.model_dtype).to(device)
    ref = None  # with LoRA the reference is the policy with its adapters disabled
    if spec.algorithm.needs_reference and spec.lora is None:
        ref = load_causal_lm(spec.model_path, spec.model_dtype).to(device)
    if spec.lora is not None:
        from postrl.train.lora import apply_lora

        policy = apply_lora(policy, spec.lora)
    common: dict[str, Any] = dict(
        temperature=spec.temperature,
        ref_model=ref,
        seed=spec.seed,
        gradient_checkpointing=spec.gradient_checkpointing,
        max_response_tokens=spec.max_response_tokens,
        proximal=spec.proximal,
        lora=spec.lora,
    )
    if world == 1:  # one process: a plain Train Worker (no collectives, no sharding)
        return PolicyTrainer(policy, spec.train, spec.algorithm, **common)
    from postrl.train.fsdp import FSDPPolicyTrainer

    precision = spec.train.precision
    bf16 = precision == "bf16_autocast" or (precision == "auto" and bf16_matmul_supported(device))
    return FSDPPolicyTrainer(policy, spec.train, spec.algorithm, bf16=bf16, **common)
