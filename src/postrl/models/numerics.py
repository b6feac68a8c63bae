"""How each side of a run computes, resolved once: the engine's dtype, the trainer's, whether the
trainer autocasts, exact mode, and where the proximal policy's logprobs come from.

A run resolves its :class:`Numerics` at start for the machine its roles run on
(:func:`resolve_numerics`), prints it once, and hands the record to what depends on it: the policy
spec (the trainer's autocast and exact forward, the proximal source), the watches (the mismatch and
update-visibility warnings) and the memory planner (which resolves it for the machine it plans for,
:meth:`Machine.planned`). The rules for ``auto`` live here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from postrl.config.algorithm import ProximalSource
from postrl.config.rollout import exact_dtype_message
from postrl.config.run import RunConfig
from postrl.models.devices import bf16_is_fast, bf16_matmul_supported, resolve_device

Dtype = Literal["float32", "bfloat16"]
IN_PROCESS_BACKENDS = ("auto", "native", "hf")  # engines postrl runs itself, on rollout.device


@dataclass(frozen=True)
class Machine:
    """What ``auto`` depends on where the roles run."""

    engine_bf16_fast: bool  # the engine's device multiplies bf16 natively (rollout.dtype: auto -> bf16)
    trainer_bf16: bool  # the trainer's device has bf16 matmuls (train.precision: auto -> bf16 autocast)
    gpu: bool  # a CUDA device is present (a device 'auto' is then the GPU)

    @staticmethod
    def here(config: RunConfig) -> Machine:
        """This machine, with the run's devices (a device this machine lacks is an error naming its field)."""
        engine = resolve_device(config.rollout.device, "rollout.device")
        if config.rollout.backend == "vllm" and torch.cuda.is_available():
            engine = torch.device("cuda")  # vLLM runs on the GPU whatever rollout.device says
        trainer = resolve_device(config.train.device, "train.device")
        return Machine(bf16_is_fast(engine), bf16_matmul_supported(trainer), torch.cuda.is_available())

    @staticmethod
    def planned(accelerator: bool) -> Machine:
        """The machine a plan is for: an accelerator has bf16; a CPU target is this one's CPU."""
        return Machine(accelerator or bf16_is_fast(torch.device("cpu")), accelerator, accelerator)


@dataclass(frozen=True)
class Numerics:
    """How the engine and the trainer compute in this run."""

    engine: Dtype  # the engine's compute dtype (an OpenAI server's: the one asked for, see engine_on_server)
    trainer: Dtype  # the dtype of the trainer's matrix products
    autocast: bool  # the trainer autocasts float32 parameters to bf16
    exact: bool  # rollout.exact: both compute every logprob alike, bit for bit
    proximal: ProximalSource  # algorithm.old_logprobs resolved
    engine_on_server: bool = False  # rollout.backend=openai: the servers' dtype is theirs (serve-rollout --dtype)

    @property
    def samples_from_a_rounding(self) -> bool:
        """The engine computes with a lower-precision copy of the trainer's float32 weights."""
        return self.engine != "float32"

    def describe(self) -> str:
        """One line: ``engine bfloat16, trainer bfloat16 autocast, exact``."""
        engine = f"engine {self.engine}" + (" (on its servers: serve-rollout --dtype)" if self.engine_on_server else "")
        trainer = f"trainer {self.trainer}" + (" autocast" if self.autocast else "")
        proximal = {
            "rollout": "the engine's logprobs as the old policy's",
            "approximate": "the old policy's logprobs approximated from the engine's",
            "recompute": "the old policy's logprobs recomputed by the trainer",
        }[self.proximal]
        return ", ".join([engine, trainer, *(["exact"] if self.exact else []), proximal])


def engine_dtype(requested: str, bf16_fast: bool) -> Dtype:
    """``rollout.dtype`` (or ``model.dtype``) resolved: ``auto`` is bf16 where bf16 is fast."""
    if requested == "auto":
        return "bfloat16" if bf16_fast else "float32"
    return "bfloat16" if requested == "bfloat16" else "float32"


def trainer_autocast(precision: str, bf16_supported: bool) -> bool:
    """``train.precision`` resolved: ``auto`` autocasts to bf16 where the device has bf16 matmuls."""
    return precision == "bf16_autocast" or (precision == "auto" and bf16_supported)


def resolve_numerics(config: RunConfig, machine: Machine | None = None) -> Numerics:
    """The run's numerics on ``machine`` (default: this one); exact mode whose dtypes resolve apart
    is an error (the config refuses the mismatches it can see without the machine)."""
    machine = machine or Machine.here(config)
    r = config.rollout
    requested = r.dtype or config.model.dtype
    engine = engine_dtype(requested, machine.engine_bf16_fast)
    if r.backend == "openai" and requested == "auto":
        engine = "bfloat16"  # the servers resolve auto where they run: counted as a rounding
    autocast = trainer_autocast(config.train.precision, machine.trainer_bf16)
    trainer: Dtype = "bfloat16" if autocast or config.model.dtype == "bfloat16" else "float32"
    if r.exact and engine != trainer:
        raise ValueError(exact_dtype_message(requested, config.train.precision, engine, trainer))
    return Numerics(
        engine, trainer, autocast, r.exact, _proximal(config, machine), engine_on_server=r.backend == "openai"
    )


def _proximal(config: RunConfig, machine: Machine) -> ProximalSource:
    """``algorithm.old_logprobs`` resolved. ``auto``: where the engine computes like the trainer
    (rollout.exact, bit for bit in any dtype; or a native or hf engine asked for float32 on the
    trainer's device, with a float32 trainer), ``rollout`` for a sync on-policy run (the engine's
    logprobs are the trainer's own) and ``approximate`` otherwise (the only gap is then the weight
    version, which is what A-3PO models, without the proximal forward that would make an async run
    slower than sync where the two share the cores); ``recompute`` wherever the numerics differ.
    The engine counts as float32 only when asked for it: ``auto`` may resolve otherwise where it runs."""
    choice = config.algorithm.old_logprobs
    if choice != "auto":
        return choice
    r, t = config.rollout, config.train
    engine_fp32 = r.backend in IN_PROCESS_BACKENDS and (r.dtype or config.model.dtype) == "float32"
    trainer_fp32 = t.precision == "float32" or (t.precision == "auto" and not (machine.gpu and t.device != "cpu"))
    same_device = r.device == t.device or not machine.gpu
    if not (r.exact or (engine_fp32 and trainer_fp32 and same_device)):
        return "recompute"
    return "rollout" if config.on_policy else "approximate"
