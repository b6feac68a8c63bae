from postrl.rollout.base import RolloutWorker
from postrl.rollout.torch_engine import TorchRolloutWorker

__all__ = ["RolloutWorker", "TorchRolloutWorker"]
