"""The scheduler a run's ``scheduler:`` section asks for: this process, or Ray actors."""

from __future__ import annotations

from collections.abc import Sequence

from postrl.config.scheduler import SchedulerConfig
from postrl.scheduling.base import Scheduler


def make_scheduler(
    scheduler: SchedulerConfig,
    import_paths: Sequence[str] = (),
    roles: tuple[str, ...] = ("rollout", "train"),
    critic: bool = False,
    more_cpus: float = 0.0,
) -> Scheduler:
    """Where the workers run: this process (and child processes), or Ray actors (``roles``: the
    placement groups to reserve; ``critic``: room for a critic actor too; ``more_cpus``: what a Ray
    instance started here also holds for the run's other schedulers)."""
    if scheduler.type == "ray":
        from postrl.scheduling.ray_scheduler import RayScheduler

        return RayScheduler(scheduler, list(import_paths), roles, critic, more_cpus)
    from postrl.scheduling.local import LocalScheduler

    return LocalScheduler(scheduler)
