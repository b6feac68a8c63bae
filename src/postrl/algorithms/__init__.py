"""Algorithms as pure tensor functions, found only through their registries."""

from postrl.algorithms.advantages import (
    ADVANTAGES,
    VALUE_TARGETS,
    AdvantageInputs,
    register_advantage,
    register_value_target,
)
from postrl.algorithms.importance import (
    IMPORTANCE_CORRECTIONS,
    ImportanceWeights,
    register_importance_correction,
)
from postrl.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    LossNormalizer,
    PolicyLossOutput,
    TokenMetric,
    kl_k3,
    kl_penalty,
    register_loss_aggregation,
    register_policy_loss,
)
from postrl.algorithms.preference import DPO_LOSSES
from postrl.algorithms.stages import STAGES, register_stage

__all__ = [
    "ADVANTAGES",
    "STAGES",
    "VALUE_TARGETS",
    "DPO_LOSSES",
    "IMPORTANCE_CORRECTIONS",
    "ImportanceWeights",
    "register_importance_correction",
    "AdvantageInputs",
    "KL_ESTIMATORS",
    "LossNormalizer",
    "kl_penalty",
    "LOSS_AGGREGATIONS",
    "LossInputs",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "TokenMetric",
    "kl_k3",
    "register_advantage",
    "register_stage",
    "register_value_target",
    "register_loss_aggregation",
    "register_policy_loss",
]
