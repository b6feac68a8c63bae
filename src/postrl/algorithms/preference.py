"""DPO-family losses on sequence log-probabilities: pure tensor functions in a registry.

Inputs are the summed log-probabilities of the chosen and rejected completions under the policy
and the (frozen) reference; ``z = (pi_c - ref_c) - (pi_r - ref_r)`` is the log-ratio margin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from postrl.algorithms.registry import Registry

DPO_LOSSES: Registry = Registry("DPO loss")


def margin(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor
) -> torch.Tensor:
    return (chosen - ref_chosen) - (rejected - ref_rejected)


@DPO_LOSSES.register("sigmoid")
def sigmoid_loss(z: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta z); with ``label_smoothing`` e (cDPO, Mitchell
    2023): -(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z), for labels flipped with
    probability e."""
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)


@DPO_LOSSES.register("ipo")
def ipo_loss(z: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO (Azar et al. 2023): (z - 1 / (2 beta))^2, which does not push the margin to infinity.
    (The paper averages log-probabilities over tokens; here z is whatever the caller passes.)"""
    return (z - 1.0 / (2.0 * beta)) ** 2


@DPO_LOSSES.register("cdpo")
def cdpo_loss(z: torch.Tensor, beta: float, label_smoothing: float = 0.1) -> torch.Tensor:
    """Conservative DPO: the sigmoid loss with label smoothing (``dpo.label_smoothing``, > 0)."""
    if label_smoothing <= 0.0:
        raise ValueError("loss_type cdpo needs dpo.label_smoothing > 0 (the assumed rate of flipped labels)")
    return sigmoid_loss(z, beta, label_smoothing)
