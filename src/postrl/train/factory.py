"""The one place a policy trainer is built: the policy, the reference model when a KL needs one,
and the optimizer (inside the Train Worker). Every scheduler calls it: the local one in this
process, each rank of an FSDP2 group in its own, each Ray actor in its."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from postrl.config.algorithm import AlgorithmConfig
from postrl.config.run import RunConfig, TrainConfig
from postrl.models.devices import bf16_matmul_supported
from postrl.train.worker import TrainWorker


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
    max_response_tokens: int = 64  # rollout.max_tokens: Dr. GRPO's constant normaliser

    @staticmethod
    def of_run(config: RunConfig) -> PolicySpec:
        """The policy of a ``postrl train`` run."""
        return PolicySpec(
            config.model.path,
            config.model.dtype,
            config.train,
            config.algorithm,
            temperature=config.rollout.temperature,
            seed=config.seed,
            gradient_checkpointing=config.model.gradient_checkpointing,
            max_response_tokens=config.rollout.max_tokens,
        )


def build_train_worker(spec: PolicySpec, device: torch.device, world: int = 1) -> TrainWorker:
    """A Train Worker on ``device``; with ``world > 1`` one rank of an FSDP2 group (the default
    process group must be initialised), whose forward and backward run in bf16 when the train
    precision asks for it."""
    from postrl.models.loading import load_causal_lm

    policy = load_causal_lm(spec.model_path, spec.model_dtype).to(device)
    ref = load_causal_lm(spec.model_path, spec.model_dtype).to(device) if spec.algorithm.needs_reference else None
    common = dict(
        temperature=spec.temperature,
        ref_model=ref,
        seed=spec.seed,
        gradient_checkpointing=spec.gradient_checkpointing,
        max_response_tokens=spec.max_response_tokens,
    )
    if world == 1:  # one process: a plain Train Worker (no collectives, no sharding)
        return TrainWorker(policy, spec.train, spec.algorithm, **common)
    from postrl.train.fsdp import FSDPTrainWorker

    precision = spec.train.precision
    bf16 = precision == "bf16_autocast" or (precision == "auto" and bf16_matmul_supported(device))
    return FSDPTrainWorker(policy, spec.train, spec.algorithm, bf16=bf16, **common)
