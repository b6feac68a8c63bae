from postrl.rollout.native.engine import NativeRolloutWorker
from postrl.rollout.native.model import SUPPORTED_MODEL_TYPES, NativeCausalLM, NativeConfig

__all__ = ["NativeCausalLM", "NativeConfig", "NativeRolloutWorker", "SUPPORTED_MODEL_TYPES"]
