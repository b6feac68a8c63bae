"""The ``model:`` section every training command shares: the model, its dtype, LoRA."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from postrl.config.base import Section


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0.0, description="Adapter scale numerator: the update is (alpha / r) * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters.",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="What a weight sync sends: adapter (A, B and the scale; the engine applies them "
        "unmerged, x W + s (x A) B, as the trainer computes) or merged (W + s B A in the engine's dtype).",
    )
    export: Literal["merged", "adapter"] = Field(
        "merged", description="final_model/: a merged Hugging Face folder, or an adapter folder that peft loads."
    )

    @model_validator(mode="after")
    def _peft_is_installed(self) -> LoraConfig:
        if importlib.util.find_spec("peft") is None:
            raise ValueError("model.lora needs peft, which is not installed: pip install 'postrl[lora]'")
        return self


class ModelConfig(Section):
    path: str = Field("demo", description="A local Hugging Face folder, a hub id, or 'demo' for the shipped model.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype for training and rollout.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    lora: LoraConfig | None = Field(
        None,
        description="Train low-rank adapters (through peft) instead of every weight; the reference model is "
        "the base model with the adapters disabled (no second copy).",
    )

    @property
    def synced_adapter_rank(self) -> int | None:
        """The LoRA rank a rollout engine must apply when syncs send adapters (None: whole weights)."""
        return self.lora.r if self.lora is not None and self.lora.sync == "adapter" else None
