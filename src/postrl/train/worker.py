"""The Train Worker: policy-gradient updates over mini-batches, micro-batches and epochs.

The loss of a micro-batch is aggregated with the *mini-batch's* token count, and gradients
accumulate across micro-batches, so the update does not depend on the micro-batch split.
A non-finite gradient norm skips the optimizer step and is counted; too many in a row raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path

import torch

from postrl.algorithms import (
    IMPORTANCE_CORRECTIONS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    LossNormalizer,
    kl_k3,
    kl_penalty,
)
from postrl.algorithms.importance import interpolated_proximal
from postrl.config.algorithm import ProximalSource
from postrl.config.run import AlgorithmConfig, LoraConfig, TrainConfig
from postrl.models.devices import bf16_matmul_supported
from postrl.models.weights import dedupe_tied, save_weights
from postrl.train.logprobs import token_logprobs
from postrl.train.lora import adapter_state, merged_state, save_lora_model
from postrl.train.memory import PeakMemory
from postrl.train.micro_batching import token_budget_micro_batches
from postrl.train.optimization import Optimization, OptimizerSettings
from postrl.train.stats import TOKENS, Stats
from postrl.types import ExperienceBatch, TrainMetrics
from postrl.types.metric_names import (
    ACTOR_ENTROPY,
    ACTOR_GRAD_NORM,
    ACTOR_KL,
    ACTOR_LOSS,
    ACTOR_LR,
    ACTOR_SKIPPED_UPDATES,
    ROLLOUT_IS_REJECTED_FRACTION,
    ROLLOUT_IS_WEIGHT_MAX,
    ROLLOUT_IS_WEIGHT_MEAN,
    ROLLOUT_LOGPROB_DIFF_MAX,
    ROLLOUT_MISMATCH_KL,
)

# measured on the update's first optimizer step only: the behaviour policy against the proximal one
MEASURED_BEFORE_UPDATE = (ROLLOUT_MISMATCH_KL, ROLLOUT_LOGPROB_DIFF_MAX)


def prepare_for_training(model: torch.nn.Module, attention: str, gradient_checkpointing: bool) -> None:
    """The attention kernel for training (:func:`set_training_attention`) and, when asked,
    activation checkpointing."""
    set_training_attention(model, attention)
    if gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()


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
        proximal: ProximalSource = "rollout",
        lora: LoraConfig | None = None,
    ) -> None:
        self.model, self.cfg, self.algo = model, train, algorithm
        self.proximal = proximal  # algorithm.old_logprobs, resolved (PolicySpec.of_run)
        self.temperature = temperature
        self.max_response_tokens = max_response_tokens  # Dr. GRPO's constant normaliser
        self.ref_model = ref_model.eval() if ref_model is not None else None
        self.lora = lora  # the model is a peft model; its reference is itself with the adapters off
        self.has_reference = self.ref_model is not None or (lora is not None and self.algo.needs_reference)
        if self.algo.needs_reference and not self.has_reference:
            raise ValueError("algorithm.kl_beta > 0 needs a reference model")
        self.kl_beta = algorithm.kl_beta  # the adaptive controller moves it (set_kl_beta)
        prepare_for_training(model, train.attention, gradient_checkpointing)
        self.policy_loss = functools.partial(
            POLICY_LOSSES.get(algorithm.policy_loss.type), **algorithm.policy_loss.options()
        )
        self.aggregate = LOSS_AGGREGATIONS.get(algorithm.loss_agg)
        self.importance = functools.partial(
            IMPORTANCE_CORRECTIONS.get(algorithm.importance.type), **algorithm.importance.options()
        )
        self.optimization = Optimization(model, OptimizerSettings.of_train(train))
        self.generator = torch.Generator().manual_seed(seed)

    is_main = True  # the process that writes files for the whole group

    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        """The policy update over ``batch``, with its peak memory (``memory/train_peak_mb``)."""
        device = next(self.model.parameters()).device
        with PeakMemory(device) as peak:
            metrics = self._update(batch.to(device))
        metrics.values["memory/train_peak_mb"] = peak.mb
        return metrics

    def _update(self, batch: ExperienceBatch) -> TrainMetrics:
        self.model.train()
        device = batch.input_ids.device
        total, before_update = Stats(), Stats()  # before_update: pi_old vs the rollout, before the first step
        grad_norms: list[float] = []
        steps_at_start = self.optimization.steps
        orders = [self._group_shuffled_order(batch) for _ in range(self.cfg.epochs)]
        # one epoch: the first mini-batch's own forward is the proximal policy (no extra forward)
        first_own = self.cfg.epochs == 1
        if self.proximal == "recompute":
            proximal = self.proximal_logprobs(batch, orders[0], skip_first=first_own)
            batch = dataclasses.replace(batch, proximal_logprobs=proximal)
        if self.proximal == "approximate" and batch.token_lags is None:
            raise ValueError("old_logprobs=approximate needs the batch's token_lags (ExperienceBatch.with_lags)")
        starts = range(0, batch.size, self.cfg.mini_batch_size)
        for epoch, order in enumerate(orders):
            for i, start in enumerate(starts):
                mini = batch.select(order[start : start + self.cfg.mini_batch_size].to(device))
                if mini.num_tokens == 0:
                    continue
                still_pi_old = self.optimization.steps == steps_at_start
                own = self._own_proximal_progress((epoch * len(starts) + i) / (len(orders) * len(starts)))
                stats, norm = self._mini_batch_step(mini, own_progress=own)
                total = total.merge(stats)
                if still_pi_old:
                    before_update = before_update.merge(stats)
                if norm is not None:
                    grad_norms.append(norm)
        self.model.eval()
        values = {k: v for k, v in total.finish(empty=0.0).items() if k not in MEASURED_BEFORE_UPDATE}
        values.update({k: v for k, v in before_update.finish().items() if k in MEASURED_BEFORE_UPDATE})
        values[ACTOR_GRAD_NORM] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        values[ACTOR_LR] = self.optimization.lr
        values[ACTOR_SKIPPED_UPDATES] = float(self.optimization.skipped)
        return TrainMetrics(values, self.optimization.steps, self.optimization.skipped)

    def _own_proximal_progress(self, progress: float) -> float | None:
        """Whether a mini-batch's proximal logprobs come from its own training forward: at which
        share of the update's optimizer steps (``approximate``: interpolated there; ``recompute``:
        the first mini-batch of a one-epoch update, before any step), or None (they are the
        batch's: recomputed before the update, or the behaviour's)."""
        if self.proximal == "approximate" or (self.proximal == "recompute" and self.cfg.epochs == 1 and progress == 0):
            return progress
        return None

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

    def micro_batches(self, mini: ExperienceBatch) -> list[tuple[torch.Tensor, ExperienceBatch]]:
        """``mini``'s micro-batches, each with the rows of ``mini`` it holds (this rank's part)."""
        return [(rows, mini.select(rows)) for rows in self.micro_batch_rows(mini)]

    def micro_batch_rows(self, batch: ExperienceBatch) -> list[torch.Tensor]:
        """Row indices of each micro-batch of ``batch``: by ``train.micro_batch_tokens`` when set,
        else consecutive runs of ``train.micro_batch_size`` rows."""
        if self.cfg.micro_batch_tokens is not None:
            return token_budget_micro_batches(batch, self.cfg.micro_batch_tokens)
        size, rows = self.cfg.micro_batch_size, torch.arange(batch.size, device=batch.input_ids.device)
        return [rows[s : s + size] for s in range(0, batch.size, size)]

    def accumulate_gradients(self, mini: ExperienceBatch, own_progress: float | None = None) -> Stats:
        """Backward over ``mini`` in micro-batches; each micro loss is normalised by mini's token count.
        ``own_progress`` (not None): each micro-batch's proximal logprobs come from its own forward,
        this far into the update (:meth:`_own_proximal_progress`). Returns the summed statistics,
        still on the device."""
        norm = self.normalizer(mini.loss_mask)
        stats = Stats()
        for _, micro in self.micro_batches(mini):
            stats = stats.merge(self._micro_batch_backward(micro, norm, own_progress))
        return stats

    @torch.no_grad()
    def proximal_logprobs(self, batch: ExperienceBatch, order: torch.Tensor, skip_first: bool = False) -> torch.Tensor:
        """The proximal policy: this trainer's logprobs of every response token before the update,
        ``[B, T-1]``. Computed over the same mini- and micro-batches, in the same order, as the first
        epoch trains on, so that the first micro-batch's ratio is exactly 1. ``skip_first``: the
        first mini-batch is left out (0): its training forward, before any step, is its proximal."""
        out = torch.zeros_like(batch.old_logprobs)
        first = self.cfg.mini_batch_size if skip_first else 0
        for start in range(first, batch.size, self.cfg.mini_batch_size):
            index = order[start : start + self.cfg.mini_batch_size].to(out.device)
            mini = batch.select(index)
            for rows, micro in self.micro_batches(mini):
                logp, _ = self._policy_logprobs(micro, with_entropy=False)
                out[index[rows]] = logp.detach().to(out.dtype)
        return self.gather_rows(out)

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows computed by the ranks, each its own part; one process computed them all."""
        return rows

    def _policy_logprobs(self, micro: ExperienceBatch, with_entropy: bool | str):
        with self._autocast():
            return token_logprobs(
                self.model,
                micro.input_ids,
                micro.attention_mask,
                self.temperature,
                with_entropy=with_entropy,
                target_mask=micro.response_mask,
                group_ids=micro.group_ids,
                lean=self.cfg.forward == "lean",
                fused_head=self.cfg.fused_head,
            )

    def normalizer(self, loss_mask: torch.Tensor, ranks: int = 1) -> LossNormalizer:
        """The mini-batch's trained tokens and sequences (already summed over ranks), over ``ranks``
        when the ranks' gradients are averaged."""
        tokens, sequences = loss_mask.sum(), (loss_mask.sum(dim=-1) > 0).sum().to(loss_mask.dtype)
        return LossNormalizer(tokens / ranks, sequences / ranks, self.max_response_tokens)

    def _mini_batch_step(self, mini: ExperienceBatch, own_progress: float | None) -> tuple[Stats, float | None]:
        """One optimizer step over ``mini``; the statistics and the gradient norm are read back from
        the device together, once."""
        sums = self.accumulate_gradients(mini, own_progress)
        stats, (norm,) = sums.read(self.optimization.clip_gradients())
        return stats, norm if self.optimization.step(norm) else None

    def _micro_batch_backward(self, micro: ExperienceBatch, norm: LossNormalizer, own_progress: float | None) -> Stats:
        mask = micro.loss_mask
        bonus = self.algo.entropy_coef
        logp, entropy = self._policy_logprobs(micro, with_entropy="grad" if bonus else True)
        if own_progress is not None:
            own = logp.detach().to(micro.old_logprobs.dtype)
            if own_progress > 0:  # after a step: A-3PO's interpolation (token_lags checked in update)
                own = interpolated_proximal(micro.old_logprobs, own, micro.token_lags, own_progress)  # type: ignore[arg-type]
            micro = dataclasses.replace(micro, proximal_logprobs=own * micro.response_mask)
        proximal = micro.old_logprobs if micro.proximal_logprobs is None else micro.proximal_logprobs
        out = self.policy_loss(LossInputs(logprobs=logp, old_logprobs=proximal, advantages=micro.advantages, mask=mask))
        per_token = out.per_token
        if micro.proximal_logprobs is not None:  # decoupled PPO: weigh by pi_prox / pi_behaviour
            weights = self.importance(proximal, micro.old_logprobs, mask)
            per_token = per_token * weights.weights
        kl = torch.zeros_like(logp)
        if self.has_reference and self.algo.kl_in == "loss":
            kl = kl_penalty(logp, self._reference(micro), self.algo.kl_estimator, self.algo.kl_clamp) * mask
            per_token = per_token + self.kl_beta * kl
        if bonus:
            per_token = per_token - bonus * entropy * mask
        self.aggregate(per_token, mask, norm).backward()
        with torch.no_grad():
            current = logp.detach().float() if micro.proximal_logprobs is None else proximal
            stats = Stats()
            stats.add(TOKENS, "sum", mask.sum())
            stats.add(ACTOR_LOSS, "token_mean", (per_token * mask).sum())
            stats.add(ACTOR_KL, "token_mean", kl.sum())
            stats.add(ACTOR_ENTROPY, "token_mean", (entropy.detach() * mask).sum())
            for name, metric in out.metrics.items():
                stats.add(name, metric.reduce, metric.reduced())
            stats.add(ROLLOUT_MISMATCH_KL, "token_mean", (kl_k3(micro.old_logprobs, current) * mask).sum())
            stats.add(ROLLOUT_LOGPROB_DIFF_MAX, "max", ((current - micro.old_logprobs) * mask).abs().max())
            if micro.proximal_logprobs is not None:
                stats.add(ROLLOUT_IS_WEIGHT_MEAN, "token_mean", weights.weights.sum())
                stats.add(ROLLOUT_IS_WEIGHT_MAX, "max", weights.weights.max())
                stats.add(ROLLOUT_IS_REJECTED_FRACTION, "token_mean", (weights.rejected.float() * mask).sum())
            return stats

    def _reference(self, micro: ExperienceBatch) -> torch.Tensor:
        """The reference model's logprobs of ``micro``'s response tokens (no gradient)."""
        reference = self.ref_model if self.ref_model is not None else self.model
        adapters_off = self.model.disable_adapter() if self.ref_model is None else contextlib.nullcontext()
        with torch.no_grad(), self._autocast(), adapters_off:
            ref_logp, _ = token_logprobs(
                reference,
                micro.input_ids,
                micro.attention_mask,
                self.temperature,
                target_mask=micro.response_mask,
                group_ids=micro.group_ids,
                lean=self.cfg.forward == "lean",
                fused_head=self.cfg.fused_head,
            )
        return ref_logp

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
        if not self.has_reference:
            raise ValueError("reference log-probabilities need a reference model (algorithm.kl_beta > 0)")
        device = next(self.model.parameters()).device
        out = [self._reference(micro.to(device)).float().cpu() for micro in batch.split(self.cfg.micro_batch_size)]
        return torch.cat(out)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends: the full weights by name (a multi-process worker gathers them;
        see FSDPTrainWorker), or with LoRA the adapters (``model.lora.sync: adapter``) or the
        merged weights (:mod:`postrl.train.lora`)."""
        if self.lora is None:
            return dedupe_tied(self.model.state_dict())
        return dedupe_tied(adapter_state(self.model) if self.lora.sync == "adapter" else merged_state(self.model))

    def save_pretrained(self, folder: str | Path) -> None:
        """The policy as a Hugging Face folder (config + safetensors); with LoRA merged or as an
        adapter folder (``model.lora.export``)."""
        if self.lora is not None:
            save_lora_model(self.model, Path(folder), self.lora.export)
            return
        save_weights(self.model, Path(folder))

    def save_checkpoint(self, path: str | Path) -> None:
        """Model and optimizer through torch.distributed.checkpoint (resharded on load, so a run can
        resume with another number of ranks), the schedule and counters, the loadable ``model/``
        folder, and the shuffling generator."""
        path = Path(path)
        self.optimization.save(path, write_state=self.is_main)
        self.save_pretrained(path / "model")
        if self.is_main:
            torch.save({"generator": self.generator.get_state()}, path / "trainer_state.pt")

    def load_checkpoint(self, path: str | Path) -> None:
        path = Path(path)
        self.optimization.load(path)
        self.generator.set_state(torch.load(path / "trainer_state.pt", weights_only=True)["generator"])

    def close(self) -> None:
        """Nothing to release beyond the model's memory, which goes with the object."""
