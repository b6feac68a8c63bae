from postrl.rollout.hf_engine import HFRolloutWorker

__all__ = ["HFRolloutWorker"]
