"""The Reward Service. Imports are lazy: scoring worker processes import only what they run
(importing torch through the service would add ~2 s to every worker (re)start)."""

from typing import Any

__all__ = ["RewardService", "ScoreRequest", "ScoringPool"]


def __getattr__(name: str) -> Any:
    if name in ("RewardService", "ScoreRequest"):
        from postrl.reward import service

        return getattr(service, name)
    if name == "ScoringPool":
        from postrl.reward.pool import ScoringPool

        return ScoringPool
    raise AttributeError(f"module 'postrl.reward' has no attribute {name!r}")
