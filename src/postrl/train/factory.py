"""The one place a policy trainer is built: the policy, the reference model when a KL needs one,
and the optimizer (inside the Train Worker). Every scheduler calls it: the local one in this
process, each rank of an FSDP2 group in its own, each Ray actor in its."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from postrl.config.algorithm import AlgorithmConfig
from postrl.config.run import LoraConfig, RunConfig, TrainConfig
from postrl.models.devices import bf16_matmul_supported
from postrl.models.numerics import Numerics, trainer_autocast
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
    numerics: Numerics | None = None  # the run's (None: proximal "rollout", not exact); autocast: on its device

    @staticmethod
    def of_run(config: RunConfig, numerics: Numerics) -> PolicySpec:
        """The policy of a ``postrl train`` run whose numerics are resolved."""
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
            numerics=numerics,
        )


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
    numerics = spec.numerics
    common: dict[str, Any] = dict(
        temperature=spec.temperature,
        ref_model=ref,
        seed=spec.seed,
        gradient_checkpointing=spec.gradient_checkpointing,
        max_response_tokens=spec.max_response_tokens,
        proximal=numerics.proximal if numerics is not None else "rollout",
        exact=numerics is not None and numerics.exact,
        lora=spec.lora,
    )
    if world == 1:  # one process: a plain Train Worker (no collectives, no sharding)
        return PolicyTrainer(policy, spec.train, spec.algorithm, **common)
    from postrl.train.fsdp import FSDPPolicyTrainer

    bf16 = trainer_autocast(spec.train.precision, bf16_matmul_supported(device))  # the rule PolicyTrainer applies
    return FSDPPolicyTrainer(policy, spec.train, spec.algorithm, bf16=bf16, **common)
