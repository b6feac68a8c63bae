"""DPO's Train Worker: the policy's sequence log-probabilities of chosen and rejected completions
against a frozen reference's (computed once and cached), one of the ``DPO_LOSSES``. The optimizer,
schedule, clipping, non-finite-gradient guard and checkpoints are the shared
:class:`~postrl.train.optimization.Optimization`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from postrl.algorithms import DPO_LOSSES
from postrl.algorithms.preference import margin
from postrl.config.dpo import DPOConfig, DPORunConfig
from postrl.config.model import LoraConfig
from postrl.config.training import OptimizerConfig
from postrl.models.host_memory import return_freed_memory
from postrl.train.logprobs import token_logprobs
from postrl.train.lora import apply_lora, save_policy
from postrl.train.optimization import Optimization, OptimizerSettings
from postrl.train.worker import prepare_for_training
from postrl.types import PreferencePair, pad_sequences
from postrl.types.metric_names import (
    ACTOR_GRAD_NORM,
    ACTOR_LR,
    ACTOR_SKIPPED_UPDATES,
    DPO_CHOSEN_REWARD,
    DPO_LOSS,
    DPO_MARGIN,
    DPO_REJECTED_REWARD,
    DPO_REWARD_ACCURACY,
)


def pair_batch(pairs: list[PreferencePair], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Rows ``prompt + chosen`` then ``prompt + rejected`` (2B rows), with the completion mask
    ``[2B, T-1]`` and group ids (a pair shares its prompt)."""
    rows = [(p.prompt_ids, c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    padded = pad_sequences(rows, pad_id)
    ids, attention, mask = padded.input_ids, padded.attention_mask, padded.response_mask
    groups = torch.arange(len(pairs)).repeat_interleave(2)
    return ids, attention, mask, groups


def sequence_logprobs(
    model: torch.nn.Module, pairs: list[PreferencePair], pad_id: int, average: bool = False, lean: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (``average``: per-token mean) completion log-probabilities: (chosen [B], rejected [B])."""
    device = next(model.parameters()).device
    ids, attention, mask, groups = (t.to(device) for t in pair_batch(pairs, pad_id))
    logp, _ = token_logprobs(model, ids, attention, target_mask=mask, group_ids=groups, lean=lean)
    total = (logp * mask).sum(dim=-1)
    if average:
        total = total / mask.sum(dim=-1).clamp(min=1)
    return total[0::2], total[1::2]


@dataclass(frozen=True)
class PreferenceSpec:
    """What builds ``postrl dpo``'s trainer, wherever its scheduler places it."""

    model_path: str
    model_dtype: str
    train: OptimizerConfig
    dpo: DPOConfig
    pad_id: int
    device: str = "cpu"
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = None  # None: full fine-tuning (and the reference: the model as loaded)

    @staticmethod
    def of_run(config: DPORunConfig, pad_id: int) -> PreferenceSpec:
        m = config.model
        return PreferenceSpec(
            m.path, m.dtype, config.train, config.dpo, pad_id, config.train.device, m.gradient_checkpointing, m.lora
        )

    def reference(self) -> PreferenceSpec:
        """The frozen starting model, whose logprobs of each pair are computed once (no LoRA)."""
        return replace(self, gradient_checkpointing=False, lora=None)

    def build(self) -> DPOWorker:
        from postrl.models.devices import resolve_device
        from postrl.models.loading import load_causal_lm

        model = load_causal_lm(self.model_path, self.model_dtype).to(resolve_device(self.device, "train.device"))
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        return DPOWorker(model, self.train, self.dpo, self.pad_id, self.gradient_checkpointing, self.lora)


class DPOWorker:
    def __init__(
        self,
        model: torch.nn.Module,
        train: OptimizerConfig,
        dpo: DPOConfig,
        pad_id: int,
        gradient_checkpointing: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        self.model = model
        self.cfg = train
        self.dpo = dpo
        self.pad_id = pad_id
        self.lora = lora  # the model is a peft model: final_model/ is saved as model.lora.export says
        prepare_for_training(model, train.attention, gradient_checkpointing)
        self.optimization = Optimization(model, OptimizerSettings.of_train(train))
        self.average = dpo.loss_type == "ipo"
        self.loss = functools.partial(
            DPO_LOSSES.get(dpo.loss_type),
            beta=dpo.beta,
            **({"label_smoothing": dpo.label_smoothing} if dpo.loss_type != "ipo" else {}),
        )

    @torch.no_grad()
    def reference_logprobs(self, pairs: list[PreferencePair]) -> torch.Tensor:
        """``[N, 2]`` (chosen, rejected) under the current weights: called once, before training,
        so the reference is the starting policy."""
        self.model.eval()
        out = []
        for start in range(0, len(pairs), self.cfg.micro_batch_size):
            chosen, rejected = sequence_logprobs(
                self.model,
                pairs[start : start + self.cfg.micro_batch_size],
                self.pad_id,
                self.average,
                self.cfg.forward == "lean",
            )
            out.append(torch.stack([chosen, rejected], dim=1).float().cpu())
        return torch.cat(out)

    def update_pairs(self, pairs: list[PreferencePair], reference: torch.Tensor) -> dict[str, float]:
        """One optimizer step over ``pairs`` (micro-batches of ``train.micro_batch_size`` pairs, the
        loss averaged over all of them) and its metrics."""
        self.model.train()
        device = next(self.model.parameters()).device
        sums = torch.zeros(5, device=device)  # loss, accuracy, margin, chosen reward, rejected reward
        for start in range(0, len(pairs), self.cfg.micro_batch_size):
            micro = pairs[start : start + self.cfg.micro_batch_size]
            ref = reference[start : start + len(micro)].to(device)
            chosen, rejected = sequence_logprobs(
                self.model, micro, self.pad_id, self.average, self.cfg.forward == "lean"
            )
            z = margin(chosen, rejected, ref[:, 0], ref[:, 1])
            loss = self.loss(z)
            (loss.sum() / len(pairs)).backward()
            with torch.no_grad():
                r_c, r_r = self.dpo.beta * (chosen - ref[:, 0]), self.dpo.beta * (rejected - ref[:, 1])
                sums += torch.stack([loss.sum(), (r_c > r_r).float().sum(), (r_c - r_r).sum(), r_c.sum(), r_r.sum()])
        norm = float(self.optimization.clip_gradients())
        self.optimization.step(norm)
        self.model.eval()
        values = (sums / len(pairs)).tolist()
        return_freed_memory()  # the step's activations, from the host's heap (postrl.models.host_memory)
        names = [DPO_LOSS, DPO_REWARD_ACCURACY, DPO_MARGIN, DPO_CHOSEN_REWARD, DPO_REJECTED_REWARD]
        return {
            **dict(zip(names, values)),
            ACTOR_GRAD_NORM: norm,
            ACTOR_LR: self.optimization.lr,
            ACTOR_SKIPPED_UPDATES: float(self.optimization.skipped),
        }

    def save_pretrained(self, folder: str | Path) -> None:
        """The policy as a Hugging Face folder (:func:`~postrl.train.lora.save_policy`)."""
        save_policy(self.model, folder, self.lora)

    def save_checkpoint(self, path: str | Path) -> None:
        self.optimization.save(Path(path))
        self.save_pretrained(Path(path) / "model")

    def load_checkpoint(self, path: str | Path) -> None:
        self.optimization.load(Path(path))

    def close(self) -> None:
        """The weights and optimizer state go with the worker."""
