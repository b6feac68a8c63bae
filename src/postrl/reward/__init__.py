from postrl.reward.pool import ScoringPool
from postrl.reward.service import RewardService, ScoreRequest

__all__ = ["RewardService", "ScoreRequest", "ScoringPool"]
