from postrl.rollout.base import RolloutWorker
from postrl.rollout.hf_engine import HFRolloutWorker

__all__ = ["RolloutWorker", "HFRolloutWorker"]
