"""Algorithms as pure tensor functions, found only through their registries."""

from postrl.algorithms.advantages import ADVANTAGES, AdvantageInputs, register_advantage
from postrl.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    LossNormalizer,
    PolicyLossOutput,
    kl_k3,
    kl_penalty,
    register_loss_aggregation,
    register_policy_loss,
)
from postrl.algorithms.preference import DPO_LOSSES

__all__ = [
    "ADVANTAGES",
    "DPO_LOSSES",
    "AdvantageInputs",
    "KL_ESTIMATORS",
    "LossNormalizer",
    "kl_penalty",
    "LOSS_AGGREGATIONS",
    "LossInputs",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "kl_k3",
    "register_advantage",
    "register_loss_aggregation",
    "register_policy_loss",
]
