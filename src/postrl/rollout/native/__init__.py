from postrl.rollout.native.engine import NativeRolloutWorker
from postrl.rollout.native.model import NativeCausalLM
from postrl.rollout.native.weights import SUPPORTED_MODEL_TYPES, NativeConfig

__all__ = ["NativeCausalLM", "NativeConfig", "NativeRolloutWorker", "SUPPORTED_MODEL_TYPES"]
