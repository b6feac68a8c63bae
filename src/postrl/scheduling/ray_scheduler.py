"""The Ray scheduler: the same worker classes as actors, placed by placement groups.

An :class:`~postrl.scheduling.ray_actors.ActorHost` builds the worker class inside the actor and
calls its methods by name, so the Controller drives Ray actors through the same handles (and the
same step code) as local objects. Without ``scheduler.address`` a local Ray instance is started for the run and shut down
at its end.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from postrl.config.off_policy import BufferConfig
from postrl.config.run import RewardConfig
from postrl.config.scheduler import SchedulerConfig
from postrl.rollout.factory import EngineSpec
from postrl.rollout.host import RolloutEngineHost
from postrl.rollout.pool import RolloutPool
from postrl.scheduling.base import RewardFactory
from postrl.scheduling.placement import make_pool
from postrl.scheduling.ray_actors import ActorHost, RayHandle, rendezvous_address
from postrl.scheduling.ray_cluster import connect_ray, short_resources
from postrl.scheduling.reaper import Reaper
from postrl.train.critic import CriticSpec
from postrl.train.dpo import PreferenceSpec
from postrl.train.factory import PolicySpec
from postrl.train.group import TrainGroup
from postrl.train.rank import GroupSpec, TrainRank
from postrl.train.teachers.teachers import TeacherSpec
from postrl.workers.clients import RewardServiceClient, client
from postrl.workers.handles import (
    InProcessHandle,
    PlacementError,
)
from postrl.workers.roles import Critic, ExperienceStore, PreferenceTrainer, Teachers, TrainWorker

log = logging.getLogger(__name__)

# a rollout engine's actor runs a generate, a weight update (or broadcast), a suspend and a health
# check at once: the engine orders them itself (new weights wait for the next decode step)
ENGINE_CONCURRENCY = 4


class RayScheduler:
    START_TIMEOUT_S = 300.0
    PLACE_TIMEOUT_S = 120.0

    def __init__(
        self,
        scheduler: SchedulerConfig,
        import_paths: list[str] | None = None,
        roles: tuple[str, ...] = ("rollout", "train"),
        critic: bool = False,
        more_cpus: float = 0.0,
    ) -> None:
        """``roles``: the placement groups to reserve (``postrl sft`` places only train ranks);
        ``import_paths``: the run's, for the actors' imports; ``critic``: room for a critic actor;
        ``more_cpus``: CPUs a Ray instance started here also gives the other schedulers of the run
        (one per policy of a run with several)."""
        import ray

        self.scheduler = scheduler
        self.roles = roles
        self.import_paths = import_paths or []
        self.critic = critic
        self.started_here = not ray.is_initialized()
        self.reaper: Reaper | None = None
        self.groups: dict[str, Any] = {}
        if self.started_here:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            local = {}
            if scheduler.address is None:  # the loop's stages take turns, so the CPUs may be promised twice
                asked = cpus_asked(scheduler, roles, critic) + more_cpus
                local["num_cpus"] = max(os.cpu_count() or 1, int(math.ceil(asked)))
                self.reaper = Reaper()  # the Ray instance started for the run dies with this process
            try:
                connect_ray(
                    scheduler.address,
                    scheduler.connect_timeout_s,
                    dict(
                        include_dashboard=False,
                        log_to_driver=False,
                        configure_logging=False,
                        runtime_env={"env_vars": self._actor_env()},
                        **local,
                    ),
                )
            except BaseException:
                self._end_reaper()
                raise
        try:
            self._place()
        except BaseException:
            self.close()
            raise

    def _end_reaper(self) -> None:
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None

    def _actor_env(self) -> dict[str, str]:
        """The actors import what the driver imports: the working directory and the config's import paths
        (custom reward functions, plugins) go on their PYTHONPATH."""
        paths = [os.getcwd(), *(os.path.abspath(p) for p in self.import_paths)]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        return {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join(paths)}

    def _bundle(self, *roles: Any) -> dict[str, float]:
        cpus = sum(r.num_cpus for r in roles)
        gpus = sum(r.num_gpus for r in roles)
        custom: dict[str, float] = {}
        for role in roles:
            for name, amount in role.resources.items():
                custom[name] = custom.get(name, 0.0) + amount
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **custom}

    def _place(self) -> None:
        """Placement groups from the resource spec; waits until they are reserved (or says why not)."""
        import ray
        from ray.util.placement_group import placement_group

        s = self.scheduler
        if s.colocate:
            n = max(s.rollout.workers, s.train.workers)
            self.groups["rollout"] = self.groups["train"] = placement_group(
                [self._bundle(s.rollout, s.train)] * n, strategy="PACK"
            )
        else:
            if "rollout" in self.roles:
                self.groups["rollout"] = placement_group([self._bundle(s.rollout)] * s.rollout.workers, strategy="PACK")
            self.groups["train"] = placement_group([self._bundle(s.train)] * s.train.workers, strategy="PACK")
        total = ray.cluster_resources()
        for role, group in self.groups.items():
            asked: dict[str, float] = {}
            for bundle in group.bundle_specs:
                for key, value in bundle.items():
                    asked[key] = asked.get(key, 0.0) + value
            lacking = {key: value for key, value in asked.items() if value > total.get(key, 0.0)}
            if lacking:  # can never be placed: say so now instead of waiting
                raise PlacementError(f"the {role} workers cannot be placed: " + short_resources(lacking))
            if not group.wait(timeout_seconds=self.PLACE_TIMEOUT_S):
                raise PlacementError(
                    f"Ray could not reserve the {role} placement group ({len(group.bundle_specs)} x "
                    f"{group.bundle_specs[0]}) within {self.PLACE_TIMEOUT_S:g} s: " + short_resources(asked)
                )

    def _actor(self, *args: Any, **kwargs: Any) -> RayHandle:
        """One actor (the arguments of :meth:`_start_actor`), started and answering."""
        handle = self._start_actor(*args, **kwargs)
        self._await_started([handle], kwargs.get("num_cpus", 1.0), kwargs.get("num_gpus", 0.0))
        return handle

    def _start_actor(
        self,
        name: str,
        role: str,
        bundle: int,
        factory: Any,
        *args: Any,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        threads: int | None = None,
        resources: dict[str, float] | None = None,
        concurrency: int = 1,
        **kwargs: Any,
    ) -> RayHandle:
        """Ask Ray for an actor; returns at once (the actor may not be placed or built yet).
        ``resources``: custom Ray resources, for an actor outside the placement groups;
        ``concurrency``: calls the actor runs at once (threads), for workers that order their own."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = None
        if role in self.groups:
            strategy = PlacementGroupSchedulingStrategy(self.groups[role], placement_group_bundle_index=bundle)
        cls = ray.remote(ActorHost).options(
            name=None,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            resources=resources or None,
            max_restarts=0,
            scheduling_strategy=strategy,
            max_concurrency=concurrency,
        )
        return RayHandle(name, cls.remote(factory, args, kwargs, threads), concurrent=concurrency > 1)

    def _await_started(self, handles: list[RayHandle], num_cpus: float, num_gpus: float) -> None:
        """Wait for every actor's constructor at once; an actor the cluster cannot place would
        otherwise make its first call wait out the call timeout."""
        import ray

        pings = [h.actor.ping.remote() for h in handles]
        ready, pending = ray.wait(pings, num_returns=len(pings), timeout=self.START_TIMEOUT_S)
        try:
            ray.get(ready)  # a constructor that raised says so here
        except ray.exceptions.RayActorError as exc:
            for h in handles:
                h.kill()
            raise PlacementError(f"a Ray actor failed to start: {str(exc).splitlines()[0]}") from None
        if pending:
            late = [h.name for h, p in zip(handles, pings) if p in pending]
            for h in handles:
                h.kill()
            raise PlacementError(
                f"Ray could not start {', '.join(late)} within {self.START_TIMEOUT_S:g} s: "
                + short_resources({"CPU": num_cpus * len(late), "GPU": num_gpus * len(late)})
            )

    def rollout_pool(self, engine: EngineSpec, tokenizer: Any, host_class: type = RolloutEngineHost) -> RolloutPool:
        """Engines as actors hosting ``host_class`` (a :class:`RolloutEngineHost` or a subclass of it)."""
        import ray

        r = self.scheduler.rollout
        n = max(1, len(self.groups["rollout"].bundle_specs))

        def start(i: int) -> RayHandle:
            spec = engine.for_index(i)  # the actor's threads are set by ActorHost
            return self._actor(
                f"rollout engine {i}",
                "rollout",
                i % n,
                host_class,
                spec,
                num_cpus=r.num_cpus,
                num_gpus=r.num_gpus,
                threads=r.threads,
                concurrency=ENGINE_CONCURRENCY,
            )

        return make_pool(engine.rollout, self.scheduler, start, host=ray.util.get_node_ip_address())

    def train_group(self, policy: PolicySpec) -> TrainWorker:
        """The train ranks as actors, building ``policy``."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s, t = self.scheduler, self.scheduler.train
        strategy = PlacementGroupSchedulingStrategy(self.groups["train"], placement_group_bundle_index=0)
        host, port = ray.get(ray.remote(rendezvous_address).options(num_cpus=0, scheduling_strategy=strategy).remote())
        group = GroupSpec(world=t.workers, master_addr=host, master_port=port, timeout_s=s.call_timeout_s)
        # all ranks are asked for together; TrainGroup then joins them into the process group at once
        ranks = [
            self._start_actor(
                f"train rank {r}",
                "train",
                r,
                TrainRank,
                r,
                group,
                policy,
                num_cpus=t.num_cpus,
                num_gpus=t.num_gpus,
                threads=t.threads,
            )
            for r in range(t.workers)
        ]
        self._await_started(ranks, t.num_cpus, t.num_gpus)
        return client(TrainGroup(ranks, call_timeout_s=s.call_timeout_s), TrainWorker)

    def critic_worker(self, critic: CriticSpec) -> Critic:
        """The critic as its own actor, with the train role's resources."""
        t = self.scheduler.train
        handle = self._actor(
            "critic", "critic", 0, critic.build, num_cpus=t.num_cpus, num_gpus=t.num_gpus, threads=t.threads
        )
        return client(handle, Critic, timeout=self.scheduler.call_timeout_s)

    def teachers(self, spec: TeacherSpec) -> Teachers:
        """A folder teacher's model in an actor of its own, with the train role's resources (its own
        device); teachers that are all servers are called from the driver."""
        if not spec.loads_a_model:
            return client(InProcessHandle(spec.build(), "teachers"), Teachers)
        t = self.scheduler.train
        handle = self._actor(
            "teachers", "teachers", 0, spec.build, num_cpus=t.num_cpus, num_gpus=t.num_gpus, threads=t.threads
        )
        return client(handle, Teachers, timeout=self.scheduler.call_timeout_s)

    def preference_trainer(self, spec: PreferenceSpec) -> PreferenceTrainer:
        """``postrl dpo``'s trainer as an actor, with the train role's resources."""
        t = self.scheduler.train
        handle = self._actor(
            "dpo trainer", "train", 0, spec.build, num_cpus=t.num_cpus, num_gpus=t.num_gpus, threads=t.threads
        )
        return client(handle, PreferenceTrainer, timeout=self.scheduler.call_timeout_s)

    def reward_service(self, make: RewardFactory, reward: RewardConfig) -> RewardServiceClient:
        """The Reward Service as an actor (started again when it dies); a remote service by URL
        (``reward.remote``) is called from the driver."""
        if reward.remote is not None:
            return RewardServiceClient(InProcessHandle(make(reward), "reward service"))

        def start() -> RayHandle:
            placed = self.scheduler.reward
            return self._actor(
                "reward service", "reward", 0, make, reward, num_cpus=placed.num_cpus, resources=placed.resources
            )

        return RewardServiceClient(start(), timeout=self.scheduler.call_timeout_s, restart=start)

    def experience_buffer(self, buffer: BufferConfig, seed: int) -> ExperienceStore:
        """The Experience Buffer as an actor of its own, apart from the engines and the trainer."""
        from postrl.buffer import ExperienceBuffer

        placed = self.scheduler.buffer
        handle = self._actor(
            "experience buffer",
            "buffer",
            0,
            ExperienceBuffer,
            buffer.max_staleness,
            buffer.on_stale,
            buffer.replay,
            seed=seed,
            num_cpus=placed.num_cpus,
            resources=placed.resources,
        )
        return client(handle, ExperienceStore, timeout=self.scheduler.call_timeout_s)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in {id(g): g for g in self.groups.values()}.values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - the cluster may already be gone
                pass
        self.groups.clear()
        if self.started_here:
            ray.shutdown()
            self._end_reaper()


def cpus_asked(s: SchedulerConfig, roles: tuple[str, ...], critic: bool) -> float:
    """The CPUs a scheduler's placement groups and actors reserve."""
    if "rollout" not in roles:
        return s.train.workers * s.train.num_cpus
    critic_cpus = s.train.num_cpus if critic else 0.0
    critic_cpus += s.buffer.num_cpus  # and the Experience Buffer's actor
    if s.colocate:
        pairs = max(s.rollout.workers, s.train.workers) * (s.rollout.num_cpus + s.train.num_cpus)
        return pairs + s.reward.num_cpus + critic_cpus
    return s.rollout.workers * s.rollout.num_cpus + s.train.workers * s.train.num_cpus + s.reward.num_cpus + critic_cpus


def teacher_cpus(config: Any) -> float:
    """What a Ray instance started for ``config``'s run (a RunConfig) also holds for a folder teacher's actor."""
    distill = config.algorithm.distill
    if distill is None or config.scheduler.type != "ray" or not TeacherSpec.of_run(config).loads_a_model:
        return 0.0
    return config.scheduler.train.num_cpus
