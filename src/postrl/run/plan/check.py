"""The check ``postrl train`` runs before it loads anything: does the plan fit the devices it sees?

On CUDA the figure to beat is each device's free memory (``torch.cuda.mem_get_info``); on the CPU
the memory the kernel reports as available (``MemAvailable``). Roles that share a device are added
up: a local run keeps its engine and its trainer on one device unless they are given two. Ray runs
place their workers on the cluster's GPUs, which this process does not see: they are not checked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from postrl.config.run import ConfigError, RunConfig
from postrl.models.devices import resolve_device
from postrl.run.plan.gpus import GPUS, GpuSpec, gpu_spec
from postrl.run.plan.planner import GB, Plan, Problem, Target, make_plan
from postrl.run.plan.shape import ShapeError

MEMINFO = Path("/proc/meminfo")


def available_ram_bytes() -> int:
    """``MemAvailable`` (Linux): what can be allocated without swapping; the total elsewhere."""
    if MEMINFO.exists():
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_target() -> Target:
    """This machine's CPU: its available RAM, nominal rates (time estimates are not the point here)."""
    return Target(GpuSpec("CPU (this machine, available RAM)", available_ram_bytes() / GB, 1.0, 50.0), 1.0, False)


def cuda_target(device: torch.device) -> Target:
    """A CUDA device as it is now: its free memory, and the rates of the preset its name matches."""
    free, _ = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    preset = next((spec for k, spec in GPUS.items() if k in key), GPUS["h100"])
    return Target(GpuSpec(f"{name} ({device}, free)", free / GB, preset.bf16_tflops, preset.bandwidth_gbs), 0.95)


def target_for(gpu: str | None, memory_gb: float | None) -> Target:
    """``postrl plan``'s ``--gpu``/``--gpu-memory``: a preset, a size, or ``cpu`` (this machine)."""
    if gpu is not None and gpu.lower() == "cpu":
        return cpu_target()
    if memory_gb is not None and memory_gb <= 0:
        raise ValueError(f"--gpu-memory {memory_gb}: give a positive number of GB")
    return Target(gpu_spec(gpu, memory_gb))


def shared_device_bytes(config: RunConfig, plan: Plan) -> int:
    """What the engine and the trainer need at once on one device: the engine's weights stay while
    the trainer updates, and its KV cache too unless it is released after each generation."""
    engine, train = plan.role("rollout engine"), plan.role("train rank")
    others = sum(r.total for r in plan.roles if r.role not in ("rollout engine", "train rank"))
    states = train.items["weights"] + train.items["gradients"] + train.items["optimizer"]
    if config.rollout.native.release_cache:
        return max(engine.total + states, engine.items["weights"] + train.total) + others
    return engine.total + train.total + others


def shared_device_problem(config: RunConfig, plan: Plan, device: str) -> Problem | None:
    """The engine and the trainer on one device (:func:`shared_device_bytes`)."""
    if plan.rollout_max_concurrency is None or plan.problems:  # each role must fit alone first
        return None
    needed = shared_device_bytes(config, plan)
    if needed <= plan.target.usable_bytes:
        return None
    fixes = ["put the engine on another device (rollout.device=cuda:1)"] if device.startswith("cuda") else []
    fixes += [f"rollout.max_batch_size={max(1, plan.rollout_max_concurrency // 2)} (a smaller KV cache)"]
    return Problem(f"rollout engine + train rank on {device}", needed, plan.target.usable_bytes, fixes)


def check_plan(config: RunConfig, echo: Callable[[str], None], target: Target | None = None) -> Plan | None:
    """``plan.check``: refuse (ConfigError naming the role, the figure and the fix) or warn when the
    run does not fit its devices; off skips it. ``target``: the device as it is now (default)."""
    if config.plan.check == "off" or config.scheduler.type == "ray":
        return None
    device = resolve_device(config.train.device, "train.device")
    target = target or (cuda_target(device) if device.type == "cuda" else cpu_target())
    try:
        plan = make_plan(config, target, gpus=max(1, config.scheduler.train.workers))
    except ShapeError as exc:  # a hub id, or an architecture the planner cannot read: not a reason to stop
        echo(f"note: the memory check was skipped ({exc})")
        return None
    same = config.rollout.backend != "openai" and resolve_device(config.rollout.device, "rollout.device") == device
    shared = shared_device_problem(config, plan, str(device)) if same else None
    problems = plan.problems + ([shared] if shared else [])
    if not problems:
        return plan
    text = "; ".join(p.message() for p in problems)
    if config.plan.check == "refuse":
        raise ConfigError(f"the run does not fit {target.gpu.name}: {text} (plan.check=warn runs it anyway)")
    echo(f"warning: the run may not fit {target.gpu.name}: {text}")
    return plan


def check_policies_plan(
    config: RunConfig, echo: Callable[[str], None], target: Target | None = None
) -> dict[str, Plan | None]:
    """A run with several policies: each policy must fit alone (:func:`check_plan`), and the
    policies whose engine and trainer share one device must fit it together (their figures added
    up): refused or warned as ``plan.check`` says, naming each policy's share."""
    runs = config.policy_runs()
    plans = {name: check_plan(run, policy_echo(name, echo), target) for name, run in runs.items()}
    shares: dict[str, list[tuple[str, int, Plan]]] = {}
    for name, plan in plans.items():
        run = runs[name]
        device = str(resolve_device(run.train.device, "train.device"))
        same = run.rollout.backend != "openai" and str(resolve_device(run.rollout.device, "rollout.device")) == device
        if plan is not None and same and plan.rollout_max_concurrency is not None:
            shares.setdefault(device, []).append((name, shared_device_bytes(run, plan), plan))
    for device, members in shares.items():
        needed, usable = sum(b for _, b, _ in members), members[0][2].target.usable_bytes
        if len(members) < 2 or needed <= usable:
            continue
        each = ", ".join(f"{name} {b / GB:.2f} GB" for name, b, _ in members)
        text = (
            f"the policies on {device} need {needed / GB:.2f} GB together ({each}), over the "
            f"{usable / GB:.2f} GB usable: give a policy its own device (policies.NAME.train.device and "
            "rollout.device), a smaller rollout.max_batch_size, or a smaller model"
        )
        if config.plan.check == "refuse":
            raise ConfigError(f"the run does not fit: {text} (plan.check=warn runs it anyway)")
        echo(f"warning: the run may not fit: {text}")
    return plans


def policy_echo(name: str, echo: Callable[[str], None]) -> Callable[[str], None]:
    """``echo`` with each line said of policy ``name``."""
    return lambda text: echo(f"policy {name}: {text}")
