"""How an async run overlaps its stages, resolved once at start for the machine it runs on
(``controller.overlap`` and ``controller.serial_compute``; docs/async.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from postrl.config.agent import EnvAgent
from postrl.config.run import RunConfig


@dataclass(frozen=True)
class Overlap:
    requested: str  # controller.overlap as the config asks (RunConfig.requested_overlap)
    serial: bool  # the engine and the trainer compute on the same cores, one after the other
    runs: str  # the overlap that runs: scoring where compute is serial, else the requested one


def computes_serially(config: RunConfig) -> bool:
    """``controller.serial_compute`` resolved (None: true when the engine runs in this process on
    the trainer's CPU: a local scheduler, an in-process engine, both devices the CPU; but not for
    an ``agent.env`` run that asks for ``overlap: generation``, whose episodes mostly wait on their
    environments: the producer thread hides that waiting, see docs/async.md)."""
    choice = config.controller.serial_compute
    if choice is not None:
        return choice
    if isinstance(config.agent, EnvAgent) and config.requested_overlap == "generation":
        return False

    def on_cpu(device: str) -> bool:
        return device == "cpu" or (device == "auto" and not torch.cuda.is_available())

    in_process = config.scheduler.type != "ray" and config.rollout.backend in ("auto", "native", "hf")
    return in_process and on_cpu(config.rollout.device) and on_cpu(config.train.device)


def resolve_overlap(config: RunConfig) -> Overlap:
    requested, serial = config.requested_overlap, computes_serially(config)
    return Overlap(requested, serial, "scoring" if serial else requested)
