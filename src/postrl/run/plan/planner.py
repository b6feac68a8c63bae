"""``postrl plan``: the memory of every role of a run per GPU, the sizes that fit, and a GPU split.

Everything is read from the run config and the models' ``config.json`` files; no weights are
loaded. The figures are the memory model's (:mod:`postrl.run.plan.memory`); the time estimates take
the GPU's dense bf16 rate and memory bandwidth at the efficiencies stated in :class:`Efficiency`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrl.config.run import RunConfig
from postrl.run.plan.fitting import fit_rollout, fit_train, max_concurrency, rollout_fixes, train_fixes
from postrl.run.plan.inputs import GB, SIZES, Efficiency, RunShape, Target, rollout_setup, run_shape, train_setup
from postrl.run.plan.memory import (
    MicroBatch,
    RoleMemory,
    TrainSetup,
    frozen_model_memory,
    micro_batch,
    train_rank_memory,
)
from postrl.run.plan.shape import ModelShape, load_shape
from postrl.run.plan.split import gpu_split, step_seconds

__all__ = ["GB", "Efficiency", "Plan", "Problem", "Target", "make_plan"]


@dataclass
class Problem:
    """A role that does not fit, with the changes that would make it fit."""

    role: str
    needed_bytes: int
    available_bytes: int
    fixes: list[str]
    sized_by: str = ""  # the fields that set the sequences' length
    per: str = "per GPU"  # "on the CPU" for a plan of this machine

    def message(self) -> str:
        sized = f" with sequences of {self.sized_by}" if self.sized_by else ""
        return (
            f"{self.role} needs {self.needed_bytes / GB:.2f} GB {self.per}{sized}, more than the "
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


def where_on(target: Target) -> str:
    return "per GPU" if target.accelerator else "on the CPU"


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
        fixes = train_fixes(config, shape, run, usable, limit)
        plan.problems.append(Problem(memory.role, memory.total, usable, fixes, run.sized_by, where_on(target)))
    for role in side_roles(config, shape, run, setup.micro, memory.ranks):
        plan.roles.append(role)
        if role.total > usable:
            plan.problems.append(
                Problem(role.role, role.total, usable, [f"more GPUs for the {role.role}"], per=where_on(target))
            )
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
        fixes = rollout_fixes(shape, setup, usable, limit)
        plan.problems.append(Problem(memory.role, memory.total, usable, fixes, run.sized_by, where_on(plan.target)))


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
