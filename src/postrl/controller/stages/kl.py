"""The KL penalty in the reward (``algorithm.kl_in: reward``) and the adaptive KL coefficient
(``algorithm.kl_target``), with the coefficient they share."""

from __future__ import annotations

from typing import Any

from postrl.algorithms import kl_penalty
from postrl.algorithms.kl_control import adaptive_kl_coef
from postrl.controller.stages.base import Stage
from postrl.types import ExperienceBatch, StepBatch, TrainMetrics
from postrl.types.metric_names import ACTOR_KL, KL_REWARD_PENALTY
from postrl.workers.roles import TrainWorker


class KLCoefficient:
    """The run's KL coefficient beta; the trainer holds a copy (for ``kl_in: loss``), kept equal."""

    def __init__(self, beta: float, trainer: TrainWorker) -> None:
        self.beta = beta
        self.trainer = trainer

    def set(self, beta: float) -> None:
        self.beta = beta
        self.trainer.set_kl_beta(beta)


class KLPenalty(Stage):
    """-beta x KL(pi_old || ref) on every response token, from the behaviour logprobs and the
    reference model's; sets ``step.ref_logprobs`` and ``step.kl_penalty`` (the token-level estimators add it to
    the outcome)."""

    name = "reference"
    phases = ("prepare",)
    needs = frozenset({"reference"})

    def __init__(self, trainer: TrainWorker, coef: KLCoefficient, estimator: str, clamp: float | None) -> None:
        self.trainer = trainer
        self.coef = coef
        self.estimator = estimator
        self.clamp = clamp
        self.last_mean = float("nan")  # the step's mean per-token KL, which the adaptive coefficient follows

    def prepare(self, step: StepBatch) -> dict[str, float]:
        batch = step.batch
        ref = step.ref_logprobs = self.trainer.reference_logprobs(batch)
        kl = kl_penalty(batch.old_logprobs, ref, self.estimator, self.clamp) * step.model_mask
        self.last_mean = float(kl.sum() / step.model_mask.sum().clamp(min=1))
        step.kl_penalty = -self.coef.beta * kl
        return {KL_REWARD_PENALTY: self.last_mean}


class AdaptiveKL(Stage):
    """Moves beta towards ``target`` (Ziegler et al. 2019) after every update, from the KL in the
    reward when there is one, else the trainer's KL in the loss."""

    name = "adaptive_kl"
    phases = ("after_update",)

    def __init__(self, coef: KLCoefficient, target: float, horizon: int, penalty: KLPenalty | None) -> None:
        self.coef = coef
        self.target = target
        self.horizon = horizon
        self.penalty = penalty

    def after_update(self, batch: ExperienceBatch, train: TrainMetrics) -> dict[str, float]:
        observed = self.penalty.last_mean if self.penalty is not None else train.get(ACTOR_KL)
        self.coef.set(adaptive_kl_coef(self.coef.beta, observed, self.target, batch.size, self.horizon))
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.coef.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef.set(float(state["beta"]))
