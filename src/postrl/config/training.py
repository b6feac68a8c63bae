"""The ``train:`` sections: what every training command's optimizer and batching share
(:class:`OptimizerConfig`, ``postrl dpo``), the Train Worker's forward and micro-batching
(:class:`PolicyTrainConfig`, ``postrl sft``), and passes over each step's experiences
(:class:`TrainConfig`, ``postrl train``). A command's section has only the fields it uses, so a
field it would ignore is refused by name."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from postrl.config.base import DEVICE_PATTERN, Section


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate (after warmup).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW's (beta1, beta2)."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup, in optimizer steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="After warm-up: constant, or a linear / cosine decay to min_lr_ratio * lr at "
        "lr_decay_steps (then held).",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="The decayed learning rate, as a fraction of lr.")
    lr_decay_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps until the decay ends. None: the run's own length (steps x "
        "optimizer steps per step, estimated from prompts_per_step x rollout.n, mini_batch_size and epochs; "
        "for dpo and sft, epochs x batches per epoch), recorded in the run's config.yaml.",
    )
    grad_clip: float = Field(1.0, gt=0.0, description="Gradients are clipped to this global norm.")
    mini_batch_size: int = Field(64, ge=1, description="Sequences per optimizer step.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward/backward.")
    max_consecutive_nan: int = Field(3, ge=1, description="Stop the run after this many skipped updates in a row.")
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Where the policy, the reference model, the "
        "batches and the optimizer state live: auto (CUDA when present), cpu, cuda, cuda:N.",
    )
    forward: Literal["lean", "transformers"] = Field(
        "lean",
        description="The training forward. lean: Llama / Qwen2 / Mistral models run postrl's own forward "
        "(flat tokens, per-block attention over shared-prompt groups, fused norms; values and gradients "
        "equal the transformers model's up to rounding), any other model (or a sharded one, or adapters other "
        "than plain LoRA) the transformers forward. transformers: always the transformers forward. With "
        "rollout.exact the policy's logprobs go through the engine's batch-invariant forward instead.",
    )
    attention: Literal["auto", "eager", "sdpa"] = Field(
        "auto",
        description="Attention kernel of the trained model. auto: eager on CPU (PyTorch's CPU SDPA backward is "
        "~20x slower than its forward), sdpa elsewhere.",
    )

    @model_validator(mode="after")
    def _micro_fits_mini(self) -> OptimizerConfig:
        if self.micro_batch_size > self.mini_batch_size:
            raise ValueError(
                f"train.micro_batch_size={self.micro_batch_size} must be <= train.mini_batch_size={self.mini_batch_size}"
            )
        return self


class PolicyTrainConfig(OptimizerConfig):
    """The Train Worker's update (``postrl sft``, and ``postrl train`` with its epochs)."""

    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per forward/backward of the policy update instead of micro_batch_size "
        "sequences: whole groups (the prompt counted once, its responses) packed into as few, about "
        "equally heavy micro-batches as fit; a group over the budget is cut into runs of rows. The "
        "update equals the fixed-size split's (the loss is normalised by the mini-batch's tokens).",
    )
    precision: Literal["auto", "float32", "bf16_autocast"] = Field(
        "auto",
        description="bf16_autocast: forward/backward matmuls in bf16, fp32 master weights and optimizer "
        "state. auto: bf16_autocast on a GPU with bf16, float32 elsewhere.",
    )
    fused_head: bool = Field(
        True,
        description="With the lean forward in bf16/fp16 at temperature 1: each chunk's softmax statistics "
        "(logprobs, entropy and the probabilities the backward reuses instead of recomputing the logits) "
        "as one kernel compiled by torch.compile (about 30 s the first time on a machine, then loaded "
        "from Inductor's cache; eager operations where it cannot compile). false: eager operations.",
    )


class TrainConfig(PolicyTrainConfig):
    """``postrl train``: the policy update over each step's experiences."""

    epochs: int = Field(1, ge=1, description="Passes over each step's experiences.")


class CheckpointConfig(Section):
    every_steps: int = Field(10, ge=0, description="Write a checkpoint every k steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    on_interrupt: bool = Field(
        True, description="On Ctrl-C/SIGTERM, checkpoint the last completed step before exiting (resume from it)."
    )
