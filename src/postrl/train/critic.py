"""The critic of PPO: a value model (a copy of the policy's backbone with a scalar head) trained
on GAE returns with a clipped value loss, as its own worker (placed like the others).

Values are per response token, aligned like the trainer's ``[B, T-1]`` tensors: the value at a
position is read from the hidden state that predicts the next token, i.e. the state before that
token is generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.config.algorithm import CriticConfig
from postrl.config.run import RunConfig
from postrl.train.optimization import Optimization, OptimizerSettings
from postrl.types import ExperienceBatch
from postrl.types.metric_names import CRITIC_CLIP_FRACTION, CRITIC_VALUE_LOSS


class ValueModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        ).last_hidden_state
        return self.head(hidden).squeeze(-1)[:, :-1].float()  # [B, T-1]: the value before token t+1


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clamp(v - old, -clip, clip)
    (PPO's value clipping; None: the plain squared error). Returns the loss and the clipped indicator."""
    plain = (values - returns) ** 2
    if clip is None:
        return 0.5 * plain * mask, torch.zeros_like(mask)
    bounded = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (bounded - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped) * mask, (clipped > plain).float() * mask


@dataclass(frozen=True)
class CriticSpec:
    """What builds a run's critic (``algorithm.critic``), wherever it is placed."""

    config: CriticConfig
    policy_path: str  # the critic starts from the policy unless algorithm.critic.path is set
    model_dtype: str
    pad_id: int
    seed: int = 0
    device: str = "cpu"

    @staticmethod
    def of_run(config: RunConfig, pad_id: int) -> CriticSpec:
        critic = config.algorithm.critic
        if critic is None:
            raise ValueError("a critic worker needs algorithm.critic")
        m = config.model
        return CriticSpec(critic, m.path, m.dtype, pad_id, config.seed, config.train.device)

    def build(self) -> CriticWorker:
        return CriticWorker(self.config, self.policy_path, self.model_dtype, self.pad_id, self.seed, self.device)


class CriticWorker:
    def __init__(
        self, config: CriticConfig, policy_path: str, model_dtype: str, pad_id: int, seed: int = 0, device: str = "cpu"
    ) -> None:
        from postrl.models.devices import resolve_device
        from postrl.models.loading import load_causal_lm

        torch.manual_seed(seed)
        self.cfg = config
        self.pad_id = pad_id
        self.device = resolve_device(device, "train.device")
        lm: Any = load_causal_lm(config.path or policy_path, model_dtype)  # a transformers model
        self.model = ValueModel(lm.get_decoder(), lm.config.hidden_size).to(self.device)
        settings = OptimizerSettings(lr=config.lr, grad_clip=config.grad_clip, what="algorithm.critic")
        self.optimization = Optimization(self.model, settings)

    @property
    def updates(self) -> int:
        """The critic's optimizer steps so far."""
        return self.optimization.steps

    @torch.no_grad()
    def values(self, batch: ExperienceBatch) -> torch.Tensor:
        """``[B, T-1]``: the value of every response position's state, 0 elsewhere (on the CPU)."""
        self.model.eval()
        out = []
        for micro in batch.split(self.cfg.micro_batch_size):
            micro = micro.trimmed().to(self.device)
            values = self.model(micro.input_ids, micro.attention_mask) * micro.response_mask
            out.append(torch.nn.functional.pad(values, (0, batch.response_mask.shape[1] - values.shape[1])).cpu())
        return torch.cat(out)

    def update(self, batch: ExperienceBatch) -> dict[str, float]:
        """``epochs`` passes of the clipped value loss towards ``batch.returns`` (around the values
        at rollout time, ``batch.values``), token-mean over the whole batch per optimizer step (one
        step per pass)."""
        if batch.values is None or batch.returns is None:
            raise ValueError("the critic's update needs the batch's values and returns (advantage: gae)")
        self.model.train()
        total = max(float(batch.response_mask.sum()), 1.0)
        stats = {CRITIC_VALUE_LOSS: 0.0, CRITIC_CLIP_FRACTION: 0.0}
        for _ in range(self.cfg.epochs):
            for micro in batch.split(self.cfg.micro_batch_size):
                micro = micro.trimmed().to(self.device)
                mask = micro.response_mask
                values = self.model(micro.input_ids, micro.attention_mask)
                assert micro.values is not None and micro.returns is not None  # the critic stage set them
                loss, clipped = clipped_value_loss(values, micro.values, micro.returns, mask, self.cfg.value_clip)
                (loss.sum() / total).backward()
                stats[CRITIC_VALUE_LOSS] += float(loss.detach().sum()) / total / self.cfg.epochs
                stats[CRITIC_CLIP_FRACTION] += float(clipped.sum()) / total / self.cfg.epochs
            self.optimization.step(float(self.optimization.clip_gradients()))
        self.model.eval()
        return stats

    def save_checkpoint(self, path: str | Path) -> None:
        self.optimization.save(Path(path))

    def load_checkpoint(self, path: str | Path) -> None:
        self.optimization.load(Path(path))

    def close(self) -> None:
        """Nothing to release beyond the model's memory, which goes with the object."""
