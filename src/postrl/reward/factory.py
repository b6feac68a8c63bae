"""The Reward Service a run's ``reward:`` section asks for."""

from __future__ import annotations

from postrl.config.run import RewardConfig
from postrl.reward.client import RemoteRewardService
from postrl.reward.service import LocalRewardService


def make_reward_service(config: RewardConfig) -> LocalRewardService | RemoteRewardService:
    """The remote service when ``reward.remote`` is set, else scoring in this process's worker pool."""
    if config.remote is not None:
        return RemoteRewardService(config.remote)
    return LocalRewardService(config)
