"""The Train Worker: policy-gradient updates over mini-batches, micro-batches and epochs.

The loss of a micro-batch is aggregated with the *mini-batch's* token count, and gradients
accumulate across micro-batches, so the update does not depend on the micro-batch split.
A non-finite gradient norm skips the optimizer step and is counted; too many in a row raise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
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
from postrl.config.algorithm import ProximalSource
from postrl.config.run import AlgorithmConfig, LoraConfig, TrainConfig
from postrl.models.devices import bf16_matmul_supported
from postrl.models.host_memory import return_freed_memory
from postrl.models.loading import hf
from postrl.models.numerics import trainer_autocast
from postrl.models.weights import dedupe_tied
from postrl.train.chunked_head import Entropy
from postrl.train.exact_forward import ExactForward
from postrl.train.logprobs import ForwardPath, plan_forward, token_logprobs
from postrl.train.lora import adapter_state, base_of, merged_state, save_policy
from postrl.train.memory import PeakMemory
from postrl.train.micro_batching import token_budget_micro_batches
from postrl.train.optimization import Optimization, OptimizerSettings
from postrl.train.proximal import proximal_policy
from postrl.train.stats import TOKENS, Stats
from postrl.train.update_visibility import Bf16Visibility
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
    TRAIN_UPDATE_VISIBLE_BF16,
)
from postrl.types.progress import Phase, phase

# measured on the update's first optimizer step only: the behaviour policy against the proximal one
MEASURED_BEFORE_UPDATE = (ROLLOUT_MISMATCH_KL, ROLLOUT_LOGPROB_DIFF_MAX)
log = logging.getLogger(__name__)


def prepare_for_training(model: torch.nn.Module, attention: str, gradient_checkpointing: bool) -> None:
    """The attention kernel for training (:func:`set_training_attention`) and, when asked,
    activation checkpointing."""
    set_training_attention(model, attention)
    if gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or hf(model).gradient_checkpointing_enable
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


class PolicyTrainer:
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
        is_main: bool = True,
        exact: bool = False,
    ) -> None:
        """``proximal`` and ``exact``: the run's :class:`~postrl.models.numerics.Numerics` (``exact``:
        the policy's logprobs through the engine's exact operations, rollout.exact)."""
        self.model = model
        self.cfg = train
        self.algo = algorithm
        self.is_main = is_main  # the process that writes files for the whole group
        # algorithm.old_logprobs, resolved (PolicySpec.of_run)
        self.proximal = proximal_policy(proximal, self.proximal_logprobs, train.epochs)
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
        self.forward_paths: Counter[ForwardPath] = Counter()  # micro-batch forwards per path (plan_forward)
        self.exact = exact
        self.exact_forward: ExactForward | None = None  # made at its first use
        # the lean forward, unless exact mode computes the policy's logprobs (the reference then
        # takes the transformers forward, as it did when train.forward was exact)
        self.lean = train.forward == "lean" and not exact
        self.autocast = trainer_autocast(train.precision, bf16_matmul_supported(next(model.parameters()).device))
        self.visibility = Bf16Visibility(model)

    def update(self, batch: ExperienceBatch) -> TrainMetrics:
        """The policy update over ``batch``, with its peak memory (``memory/train_peak_mb``)."""
        device = next(self.model.parameters()).device
        with PeakMemory(device) as peak:
            metrics = self._update(batch.to(device))
        metrics.values["memory/train_peak_mb"] = peak.mb
        return_freed_memory()  # the update's activations, from the host's heap (postrl.models.host_memory)
        return metrics

    def _update(self, batch: ExperienceBatch) -> TrainMetrics:
        self.model.train()
        device = batch.input_ids.device
        total, before_update = Stats(), Stats()  # before_update: pi_old vs the rollout, before the first step
        grad_norms: list[float] = []
        steps_at_start = self.optimization.steps
        orders = [self._group_shuffled_order(batch) for _ in range(self.cfg.epochs)]
        batch = self.proximal.prepare(batch, orders[0])
        self.visibility.start()
        starts = range(0, batch.size, self.cfg.mini_batch_size)
        with phase("update", len(orders) * batch.size, "samples") as shown:
            for epoch, order in enumerate(orders):
                for i, start in enumerate(starts):
                    mini = batch.select(order[start : start + self.cfg.mini_batch_size].to(device))
                    if mini.num_tokens == 0:
                        shown.advance(mini.size)
                        continue
                    still_pi_old = self.optimization.steps == steps_at_start
                    progress = (epoch * len(starts) + i) / (len(orders) * len(starts))
                    stats, norm = self._mini_batch_step(mini, progress, shown)
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
        visible = self.visibility.share()
        if visible is not None:
            values[TRAIN_UPDATE_VISIBLE_BF16] = visible
        return TrainMetrics(values, self.optimization.steps, self.optimization.skipped)

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

    def accumulate_gradients(self, mini: ExperienceBatch, progress: float = 0.0, shown: Phase | None = None) -> Stats:
        """Backward over ``mini`` in micro-batches; each micro loss is normalised by mini's token
        count. ``progress``: the share of the update's mini-batches done (the proximal policy may
        depend on it); ``shown``: the update's phase, advanced by each micro-batch's rows. Returns
        the summed statistics, still on the device."""
        norm = self.loss_normalizer(mini)
        micro_batches = self.micro_batches(mini)
        stats = Stats()
        for i, (_, micro) in enumerate(micro_batches):
            self.before_micro_batch(i, len(micro_batches))
            stats = stats.merge(self._micro_batch_backward(micro, norm, progress))
            if shown is not None:
                shown.advance(micro.size)
        return self.reduce_stats(stats)

    def loss_normalizer(self, mini: ExperienceBatch) -> LossNormalizer:
        """The mini-batch's trained tokens and sequences, by which every micro-batch's loss is divided."""
        mask = mini.loss_mask
        tokens, sequences = mask.sum(), (mask.sum(dim=-1) > 0).sum().to(mask.dtype)
        return LossNormalizer(tokens, sequences, self.max_response_tokens)

    def before_micro_batch(self, index: int, count: int) -> None:
        """Called before each of a mini-batch's ``count`` micro-batches (a sharded worker syncs gradients on the last)."""

    def reduce_stats(self, stats: Stats) -> Stats:
        """A mini-batch's statistics over the workers that shared it (one process: as they are)."""
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
                logp, _ = self._policy_logprobs(micro, "off")
                out[index[rows]] = logp.detach().to(out.dtype)
        return self.gather_rows(out)

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows computed by the ranks, each its own part; one process computed them all."""
        return rows

    def _policy_logprobs(self, micro: ExperienceBatch, with_entropy: Entropy) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's logprobs of ``micro``'s responses, and their entropy (zeros when "off")."""
        plan = plan_forward(
            self.model,
            micro.input_ids,
            micro.attention_mask,
            micro.response_mask,
            micro.group_ids,
            lean=self.lean,
            exact=self.exact,
        )
        if plan.path not in self.forward_paths:
            log.info("train forward: %s (%s)", plan.path, plan.why)
        self.forward_paths[plan.path] += 1
        with self._autocast():
            logp, entropy = token_logprobs(
                self.model,
                micro.input_ids,
                micro.attention_mask,
                self.temperature,
                with_entropy,
                micro.response_mask,
                micro.group_ids,
                fused_head=self.cfg.fused_head,
                plan=plan,
                exact_forward=self._exact_forward() if plan.path == "exact" else None,
            )
        return logp, torch.zeros_like(logp) if entropy is None else entropy

    def _exact_forward(self) -> ExactForward:
        """The model's exact forward, made once: it keeps the rounded weights between micro-batches."""
        if self.exact_forward is None:
            self.exact_forward = ExactForward(base_of(self.model))
        self.exact_forward.weights.at(self.optimization.weight_changes)
        return self.exact_forward

    def _mini_batch_step(self, mini: ExperienceBatch, progress: float, shown: Phase) -> tuple[Stats, float | None]:
        """One optimizer step over ``mini``; the statistics and the gradient norm are read back from
        the device together, once."""
        sums = self.accumulate_gradients(mini, progress, shown)
        stats, (norm,) = sums.read(self.optimization.clip_gradients())
        return stats, norm if self.optimization.step(norm) else None

    def _micro_batch_backward(self, micro: ExperienceBatch, norm: LossNormalizer, progress: float) -> Stats:
        mask = micro.loss_mask
        bonus = self.algo.entropy_coef
        logp, entropy = self._policy_logprobs(micro, "grad" if bonus else "value")
        proximal = self.proximal.for_micro(micro, logp.detach().to(micro.old_logprobs.dtype), progress)
        old = micro.old_logprobs if proximal is None else proximal
        out = self.policy_loss(LossInputs(logprobs=logp, old_logprobs=old, advantages=micro.advantages, mask=mask))
        per_token = out.per_token
        if proximal is not None:  # decoupled PPO: weigh by pi_prox / pi_behaviour
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
            current = logp.detach().float() if proximal is None else proximal
            stats = Stats()
            stats.add(TOKENS, "sum", mask.sum())
            stats.add(ACTOR_LOSS, "token_mean", (per_token * mask).sum())
            stats.add(ACTOR_KL, "token_mean", kl.sum())
            stats.add(ACTOR_ENTROPY, "token_mean", (entropy.detach() * mask).sum())
            for name, metric in out.metrics.items():
                stats.add(name, metric.reduce, metric.reduced())
            stats.add(ROLLOUT_MISMATCH_KL, "token_mean", (kl_k3(micro.old_logprobs, current) * mask).sum())
            stats.add(ROLLOUT_LOGPROB_DIFF_MAX, "max", ((current - micro.old_logprobs) * mask).abs().max())
            if proximal is not None:
                stats.add(ROLLOUT_IS_WEIGHT_MEAN, "token_mean", weights.weights.sum())
                stats.add(ROLLOUT_IS_WEIGHT_MAX, "max", weights.weights.max())
                stats.add(ROLLOUT_IS_REJECTED_FRACTION, "token_mean", (weights.rejected.float() * mask).sum())
            return stats

    def _reference(self, micro: ExperienceBatch) -> torch.Tensor:
        """The reference model's logprobs of ``micro``'s response tokens (no gradient)."""
        reference = self.ref_model if self.ref_model is not None else self.model
        adapters_off = hf(self.model).disable_adapter() if self.ref_model is None else contextlib.nullcontext()
        with torch.no_grad(), self._autocast(), adapters_off:
            ref_logp, _ = token_logprobs(
                reference,
                micro.input_ids,
                micro.attention_mask,
                self.temperature,
                target_mask=micro.response_mask,
                group_ids=micro.group_ids,
                lean=self.lean,
                fused_head=self.cfg.fused_head,
            )
        return ref_logp

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=next(self.model.parameters()).device.type, dtype=torch.bfloat16)

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
        see FSDPPolicyTrainer), or with LoRA the adapters (``model.lora.sync: adapter``) or the
        merged weights (:mod:`postrl.train.lora`)."""
        if self.lora is None:
            return dedupe_tied(self.model.state_dict())
        return dedupe_tied(adapter_state(self.model) if self.lora.sync == "adapter" else merged_state(self.model))

    def save_pretrained(self, folder: str | Path) -> None:
        """The policy as a Hugging Face folder (:func:`~postrl.train.lora.save_policy`)."""
        save_policy(self.model, folder, self.lora)

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
