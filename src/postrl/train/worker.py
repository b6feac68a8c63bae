"""The Train Worker: policy-gradient updates over mini-batches, micro-batches and epochs.

The loss of a micro-batch is aggregated with the *mini-batch's* token count, and gradients
accumulate across micro-batches, so the update does not depend on the micro-batch split.
A non-finite gradient norm skips the optimizer step and is counted; too many in a row raise.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from postrl.algorithms import LOSS_AGGREGATIONS, POLICY_LOSSES, LossInputs, LossNormalizer, kl_k3, kl_penalty
from postrl.config.run import AlgorithmConfig, TrainConfig
from postrl.models.devices import bf16_matmul_supported
from postrl.models.weights import load_weights_into, save_weights
from postrl.train.logprobs import token_logprobs
from postrl.train.lr_schedule import make_scheduler
from postrl.train.state import full_tensor, load_train_state, save_train_state
from postrl.types import ExperienceBatch, TrainMetrics


@dataclass(frozen=True)
class MicroBatchStats:
    """Sums over a micro-batch's trained tokens (and the largest |logprob - behaviour logprob|),
    as 0-d tensors on the device: adding them costs no device-to-host copy."""

    loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clipped: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    dual_clip: torch.Tensor
    approx_kl: torch.Tensor
    tokens: torch.Tensor
    mismatch_kl: torch.Tensor
    logprob_diff_max: torch.Tensor

    @staticmethod
    def zeros(device: torch.device) -> MicroBatchStats:
        return MicroBatchStats(*(torch.zeros((), device=device) for _ in fields(MicroBatchStats)))

    def __add__(self, other: MicroBatchStats) -> MicroBatchStats:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        sums["logprob_diff_max"] = torch.maximum(self.logprob_diff_max, other.logprob_diff_max)
        return MicroBatchStats(**sums)

    def read(self, grad_norm: torch.Tensor) -> tuple[MiniBatchStats, float]:
        """Everything, and the gradient norm, in one copy from the device."""
        values = torch.stack([grad_norm.float(), *(getattr(self, f.name).float() for f in fields(self))]).tolist()
        return MiniBatchStats(*values[1:]), values[0]


@dataclass(frozen=True)
class MiniBatchStats:
    """:class:`MicroBatchStats` read back as numbers, summed across mini-batches."""

    loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clipped: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    dual_clip: float = 0.0
    approx_kl: float = 0.0
    tokens: float = 0.0
    mismatch_kl: float = 0.0
    logprob_diff_max: float = 0.0

    @staticmethod
    def empty() -> MiniBatchStats:
        return MiniBatchStats()

    def __add__(self, other: MiniBatchStats) -> MiniBatchStats:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        sums["logprob_diff_max"] = max(self.logprob_diff_max, other.logprob_diff_max)
        return MiniBatchStats(**sums)


class NonFiniteLossError(RuntimeError):
    """Raised after ``train.max_consecutive_nan`` skipped updates in a row."""


def set_training_attention(model: torch.nn.Module, choice: str) -> str:
    """Pick the attention kernel used for training; returns the one in effect.

    On CPU, PyTorch's fused SDPA backward costs ~50 ms per layer on a 16 x 112 micro-batch against
    ~3 ms for its forward, while the plain matmul/softmax (eager) path differentiates at matmul speed.
    """
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return "unchanged"
    if choice == "auto":
        device = next(model.parameters()).device.type
        choice = "eager" if device == "cpu" else "sdpa"
    setter(choice)
    return choice


class TrainWorker:
    def __init__(
        self,
        model: torch.nn.Module,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        temperature: float = 1.0,
        ref_model: torch.nn.Module | None = None,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        max_response_tokens: int = 64,
    ) -> None:
        self.model, self.cfg, self.algo = model, train, algorithm
        self.temperature = temperature
        self.max_response_tokens = max_response_tokens  # Dr. GRPO's constant normaliser
        self.ref_model = ref_model.eval() if ref_model is not None else None
        if self.algo.kl_beta > 0 and self.ref_model is None:
            raise ValueError("algorithm.kl_beta > 0 needs a reference model")
        self.kl_beta = algorithm.kl_beta  # the adaptive controller moves it (set_kl_beta)
        set_training_attention(model, train.attention)
        if gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        self.policy_loss = functools.partial(
            POLICY_LOSSES.get(algorithm.policy_loss.type), **algorithm.policy_loss.options()
        )
        self.aggregate = LOSS_AGGREGATIONS.get(algorithm.loss_agg)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=train.lr, betas=train.betas, weight_decay=train.weight_decay
        )
        self.scheduler = make_scheduler(
            self.optimizer, train.lr_schedule, train.warmup_steps, train.lr_decay_steps, train.min_lr_ratio
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0

    is_main = True  # the process that writes files for the whole group

    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        self.model.train()
        device = next(self.model.parameters()).device
        batch = batch.to(device)
        total = MiniBatchStats.empty()
        before_update = MiniBatchStats.empty()  # pi_old vs the rollout: only before the first optimizer step
        grad_norms: list[float] = []
        steps_at_start = self.optimizer_steps
        for _ in range(self.cfg.epochs):
            order = self._group_shuffled_order(batch)
            for start in range(0, batch.size, self.cfg.mini_batch_size):
                mini = batch.select(order[start : start + self.cfg.mini_batch_size].to(device))
                if mini.num_tokens == 0:
                    continue
                still_pi_old = self.optimizer_steps == steps_at_start
                stats, norm = self._mini_batch_step(mini)
                total = total + stats
                if still_pi_old:
                    before_update = before_update + stats
                if norm is not None:
                    grad_norms.append(norm)
        self.model.eval()
        tokens = max(total.tokens, 1.0)
        return TrainMetrics(
            mismatch_kl=before_update.mismatch_kl / before_update.tokens if before_update.tokens else float("nan"),
            logprob_diff_max=before_update.logprob_diff_max if before_update.tokens else float("nan"),
            loss=total.loss / tokens,
            kl=total.kl / tokens,
            entropy=total.entropy / tokens,
            clip_fraction=total.clipped / tokens,
            clip_low_fraction=total.clip_low / tokens,
            clip_high_fraction=total.clip_high / tokens,
            dual_clip_fraction=total.dual_clip / tokens,
            approx_kl=total.approx_kl / tokens,
            grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            learning_rate=self.scheduler.get_last_lr()[0],
            optimizer_steps=self.optimizer_steps,
            skipped_steps=self.skipped_steps,
        )

    def _group_shuffled_order(self, batch: ExperienceBatch) -> torch.Tensor:
        """A random order of the rows that keeps the samples of one group (one prompt) together.

        Mini-batches then hold whole GRPO groups, and micro-batches let the samples of a group share
        one prompt forward (see :func:`postrl.train.logprobs.pack_shared_prompts`).
        """
        groups: dict[int, list[int]] = {}
        for row, group in enumerate(batch.group_ids.tolist()):
            groups.setdefault(group, []).append(row)
        members = list(groups.values())
        shuffled = torch.randperm(len(members), generator=self.generator).tolist()
        return torch.tensor([row for g in shuffled for row in members[g]], dtype=torch.long)

    def accumulate_gradients(self, mini: ExperienceBatch) -> MicroBatchStats:
        """Backward over ``mini`` in micro-batches; each micro loss is normalised by mini's token count.
        Returns the summed statistics, still on the device."""
        norm = self.normalizer(mini.loss_mask)
        stats = MicroBatchStats.zeros(mini.input_ids.device)
        for start in range(0, mini.size, self.cfg.micro_batch_size):
            micro = mini.select(slice(start, start + self.cfg.micro_batch_size))
            stats = stats + self._micro_batch_backward(micro, norm)
        return stats

    def normalizer(self, loss_mask: torch.Tensor, ranks: int = 1) -> LossNormalizer:
        """The mini-batch's trained tokens and sequences (already summed over ranks), over ``ranks``
        when the ranks' gradients are averaged."""
        tokens, sequences = loss_mask.sum(), (loss_mask.sum(dim=-1) > 0).sum().to(loss_mask.dtype)
        return LossNormalizer(tokens / ranks, sequences / ranks, self.max_response_tokens)

    def _mini_batch_step(self, mini: ExperienceBatch) -> tuple[MiniBatchStats, float | None]:
        """One optimizer step over ``mini``; the statistics and the gradient norm are read back from
        the device together, once."""
        sums = self.accumulate_gradients(mini)
        norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        stats, norm_value = sums.read(norm)
        if not math.isfinite(norm_value):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.cfg.max_consecutive_nan:
                raise NonFiniteLossError(
                    f"{self.consecutive_skips} updates in a row had a non-finite gradient norm; stopping "
                    "(lower train.lr, check rewards for inf/NaN, or raise train.max_consecutive_nan)"
                )
            return stats, None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.consecutive_skips = 0
        return stats, norm_value

    def _micro_batch_backward(self, micro: ExperienceBatch, norm: LossNormalizer) -> MicroBatchStats:
        mask = micro.loss_mask
        bonus = self.algo.entropy_coef
        with self._autocast():
            logp, entropy = token_logprobs(
                self.model,
                micro.input_ids,
                micro.attention_mask,
                self.temperature,
                with_entropy="grad" if bonus else True,
                target_mask=micro.response_mask,
                group_ids=micro.group_ids,
            )
        out = self.policy_loss(
            LossInputs(
                logprobs=logp,
                old_logprobs=micro.old_logprobs,
                advantages=micro.advantages,
                mask=mask,
            )
        )
        per_token = out.per_token
        kl = torch.zeros_like(logp)
        if self.ref_model is not None and self.algo.kl_in == "loss":
            with torch.no_grad(), self._autocast():
                ref_logp, _ = token_logprobs(
                    self.ref_model,
                    micro.input_ids,
                    micro.attention_mask,
                    self.temperature,
                    target_mask=micro.response_mask,
                    group_ids=micro.group_ids,
                )
            kl = kl_penalty(logp, ref_logp, self.algo.kl_estimator, self.algo.kl_clamp) * mask
            per_token = per_token + self.kl_beta * kl
        if bonus:
            per_token = per_token - bonus * entropy * mask
        self.aggregate(per_token, mask, norm).backward()
        with torch.no_grad():
            current = logp.detach().float()
            zero = torch.zeros((), device=mask.device)
            return MicroBatchStats(
                loss=(per_token * mask).sum(),
                kl=kl.sum(),
                entropy=(entropy.detach() * mask).sum(),
                clipped=out.clipped.sum(),
                tokens=mask.sum(),
                clip_low=zero if out.clip_low is None else out.clip_low.sum(),
                clip_high=zero if out.clip_high is None else out.clip_high.sum(),
                dual_clip=zero if out.dual_clip is None else out.dual_clip.sum(),
                approx_kl=zero if out.approx_kl is None else out.approx_kl.sum(),
                mismatch_kl=(kl_k3(micro.old_logprobs, current) * mask).sum(),
                logprob_diff_max=((current - micro.old_logprobs) * mask).abs().max(),
            )

    def _autocast(self) -> contextlib.AbstractContextManager:
        device = next(self.model.parameters()).device
        bf16 = self.cfg.precision == "bf16_autocast" or (self.cfg.precision == "auto" and bf16_matmul_supported(device))
        if not bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def set_kl_beta(self, beta: float) -> None:
        self.kl_beta = beta

    @torch.no_grad()
    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """The reference model's logprob of every response token, ``[B, T-1]`` (0 elsewhere), on the CPU."""
        if self.ref_model is None:
            raise ValueError("reference log-probabilities need a reference model (algorithm.kl_beta > 0)")
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, batch.size, self.cfg.micro_batch_size):
            micro = batch.select(slice(start, start + self.cfg.micro_batch_size)).to(device)
            with self._autocast():
                logp, _ = token_logprobs(
                    self.ref_model,
                    micro.input_ids,
                    micro.attention_mask,
                    self.temperature,
                    target_mask=micro.response_mask,
                    group_ids=micro.group_ids,
                )
            out.append(logp.float().cpu())
        return torch.cat(out)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The full weights, by name (a multi-process worker gathers them; see FSDPTrainWorker)."""
        return self.model.state_dict()

    def save_pretrained(self, folder: str | Path) -> None:
        """The policy as a Hugging Face folder (config + safetensors)."""
        save_weights(self.model, Path(folder))

    def save_checkpoint(self, path: str | Path) -> None:
        """Model and optimizer through torch.distributed.checkpoint (resharded on load, so a run can
        resume with another number of ranks), the loadable ``model/`` folder, and the scheduler,
        generator and counters."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_train_state(self.model, self.optimizer, path / "dcp")
        self.save_pretrained(path / "model")
        if self.is_main:
            torch.save(self._loop_state(), path / "trainer_state.pt")

    def load_checkpoint(self, path: str | Path) -> None:
        path = Path(path)
        if (path / "dcp").is_dir():
            load_train_state(self.model, self.optimizer, path / "dcp")
            state = torch.load(path / "trainer_state.pt", weights_only=True)
        else:  # a checkpoint written before sharded checkpoints: full weights + optimizer.pt
            load_weights_into(self.model, path / "model")
            state = torch.load(path / "optimizer.pt", weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.optimizer_steps, self.skipped_steps, self.consecutive_skips = state["counters"]

    def close(self) -> None:
        """Nothing to release beyond the model's memory, which goes with the object."""

    def _loop_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "counters": [self.optimizer_steps, self.skipped_steps, self.consecutive_skips],
        }
