"""Where the workers run: ``scheduler.type`` local (this process, plus child processes when a role
has several workers) or ray (actors in placement groups), with the resources of each role."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from postrl.config.base import Section


class RoleResources(Section):
    workers: int = Field(1, ge=1, description="Processes (actors) of this role.")
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs reserved per worker (Ray placement).")
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs reserved per worker (Ray placement); fractions share one.")
    resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=dict,
        description="Custom Ray resources reserved per worker, e.g. {gen_node: 1} to place this role on the nodes "
        "started with that resource.",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker; None: all of the machine's cores "
        "(the loop's stages run one after another, so a stage may use them all).",
    )


class RewardResources(Section):
    num_cpus: float = Field(
        1.0,
        ge=0.0,
        description="CPUs reserved for the Reward Service actor (its scoring "
        "processes run inside it, up to reward.max_workers).",
    )
    resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=dict, description="Custom Ray resources the Reward Service actor needs (its node)."
    )


class BufferResources(Section):
    num_cpus: float = Field(0.1, ge=0.0, description="CPUs reserved for the Experience Buffer actor (Ray).")
    resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=dict, description="Custom Ray resources the Experience Buffer actor needs (its node)."
    )


class SchedulerConfig(Section):
    type: Literal["local", "ray"] = Field(
        "local",
        description="local: workers in this process (and child processes "
        "for several workers); ray: Ray actors in placement groups.",
    )
    address: str | None = Field(
        None,
        description="Ray cluster address (ray://... or host:port); None starts a local "
        "Ray instance for the run and shuts it down at the end.",
    )
    colocate: bool = Field(
        False,
        description="Ray: rollout engine i and train rank i share one placement bundle "
        "(one node, e.g. one GPU split between them); else each role has its own placement group.",
    )
    rollout: RoleResources = Field(default_factory=RoleResources, description="Rollout engines.")
    train: RoleResources = Field(
        default_factory=RoleResources, description="Train ranks (an FSDP2 group when workers > 1)."
    )
    reward: RewardResources = Field(default_factory=RewardResources, description="The Reward Service (Ray).")
    buffer: BufferResources = Field(default_factory=BufferResources, description="The Experience Buffer (Ray).")
    rollout_schedule: dict[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict,
        description="{step: engines}: before that step the pool grows or shrinks to that many engines.",
    )
    connect_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Longest connecting to the Ray cluster at "
        "`address` may take before the run stops, naming the address.",
    )
    call_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        description="Longest any remote call may take (generate, update, "
        "weight sync) before its worker is declared lost.",
    )
