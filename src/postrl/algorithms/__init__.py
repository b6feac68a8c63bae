"""Algorithms as pure tensor functions, found only through their registries."""

from postrl.algorithms.advantages import ADVANTAGES, AdvantageInputs, register_advantage
from postrl.algorithms.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    PolicyLossOutput,
    kl_k3,
    register_loss_aggregation,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGES",
    "AdvantageInputs",
    "LOSS_AGGREGATIONS",
    "LossInputs",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "kl_k3",
    "register_advantage",
    "register_loss_aggregation",
    "register_policy_loss",
]
