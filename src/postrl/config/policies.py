"""``policies:``: several trainable policies in one run (a proposer and a solver, two players of a
game). Each policy has its own model, trainer, engines, optimizer, weight version and checkpoint;
the run's episodes say which policy answers each model call: an agent function (``agent.function``)
by the request's ``model`` name or by the policy's base URL, a seated environment (``agent.env``
with ``agent.seats``) by the seat whose turn it is. A policy's sections are merged over the run's: a key a
policy names replaces the run's, the rest is the run's (``policies: {solver: {train: {lr: 1e-6}}}``
changes the solver's learning rate only)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from postrl.config.base import Section

POLICY_NAME = r"^[A-Za-z][A-Za-z0-9_.-]*$"  # a model name in requests, a metric prefix and a folder name
POLICY_SECTIONS = ("model", "train", "rollout", "algorithm")


class PolicyConfig(Section):
    """One trainable policy: each section given is merged over the run's section of that name."""

    model: dict[str, Any] = Field(
        default_factory=dict, description="Over the run's model section: model.path, lora, dtype, ..."
    )
    train: dict[str, Any] = Field(
        default_factory=dict, description="Over the run's train section: this policy's optimizer and batching."
    )
    rollout: dict[str, Any] = Field(
        default_factory=dict,
        description="Over the run's rollout section: this policy's engine (rollout.n is the run's: every policy "
        "acts in the same episodes).",
    )
    algorithm: dict[str, Any] = Field(
        default_factory=dict, description="Over the run's algorithm section: this policy's advantage, loss and KL."
    )


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s keys: nested mappings merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def check_seats(seats: dict[str, str], policies: list[str]) -> None:
    """``agent.seats`` maps seats to this run's policies, every policy to exactly one seat (a policy
    with no seat would never act; one with two would get one reward for both)."""
    for seat, policy in seats.items():
        if policy not in policies:
            raise ValueError(f"agent.seats.{seat}: '{policy}' is not a policy of this run ({', '.join(policies)})")
    for policy in policies:
        held = [seat for seat, p in seats.items() if p == policy]
        if not held:
            raise ValueError(f"agent.seats: policy '{policy}' plays no seat, so it would never act")
        if len(held) > 1:
            raise ValueError(
                f"agent.seats: policy '{policy}' plays seats {held}; each policy plays one seat (its episode reward is "
                "its seat's): give each seat its own policy (several may start from one model)"
            )
