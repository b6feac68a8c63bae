"""The KL coefficient's controller: fixed, or adaptive towards a target KL (Ziegler et al. 2019)."""

from __future__ import annotations


def adaptive_kl_coef(beta: float, observed_kl: float, target_kl: float, samples: int, horizon: int) -> float:
    """beta x (1 + clip(observed / target - 1, -0.2, 0.2) x samples / horizon): raised while the
    policy drifts further than the target, lowered while it stays closer. A non-finite observation
    (no trained token) leaves beta as it is."""
    if not (observed_kl == observed_kl) or observed_kl in (float("inf"), float("-inf")):
        return beta
    error = min(max(observed_kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * samples / horizon)
