"""What the run says on the console besides the per-step line: where its workers were placed, and
warnings about steps that teach nothing or about a rollout engine whose logprobs disagree with the
trainer's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from postrl.config.agent import FunctionAgent, VerifiersAgent
from postrl.config.run import RunConfig
from postrl.models.numerics import Numerics, resolve_numerics
from postrl.types import StepMetrics
from postrl.types.metric_names import (
    REWARD_NO_SIGNAL_GROUPS,
    ROLLOUT_LOGPROB_DIFF_MAX,
    ROLLOUT_MISMATCH_KL,
    TRAIN_UPDATE_VISIBLE_BF16,
)


class Watch(Protocol):
    def observe(self, metrics: StepMetrics) -> None: ...


class NoSignalWatch:
    """Says so plainly when several steps in a row had no group with differing rewards."""

    def __init__(self, echo: Callable[[str], None], limit: int = 3, source: str = "the reward function") -> None:
        self.echo = echo
        self.limit = limit
        self.streak = 0
        self.source = source

    def observe(self, metrics: StepMetrics) -> None:
        self.streak = self.streak + 1 if metrics.values.get(REWARD_NO_SIGNAL_GROUPS, 0.0) >= 1.0 else 0
        if self.streak == self.limit:
            self.echo(
                f"warning: in the last {self.limit} steps every group's samples got identical rewards, so nothing "
                f"was learned: the reward never varies. Check {self.source} (postrl eval --run, "
                "samples/step_N.jsonl) or the task's difficulty (every answer right, or every answer wrong)"
            )


def engine_precision(config: RunConfig, numerics: Numerics) -> str:
    r = config.rollout
    if numerics.engine_on_server:
        return f"the rollout servers at {r.url} (in the dtype they were started with: serve-rollout --dtype)"
    return f"the {r.backend} engine in {numerics.engine}"


def trainer_precision(numerics: Numerics) -> str:
    return "bf16 autocast" if numerics.autocast else numerics.trainer


class MismatchWatch:
    """Warns once when the engine's logprobs of the sampled tokens differ from the trainer's by more
    than ``max_diff``: the PPO ratio then compares two different policies. Only in an on-policy run:
    where samples lag the trainer (async, staleness, replay) the gap is the lag's, expected and
    corrected by ``algorithm.importance``, and says nothing about the engine's precision."""

    def __init__(
        self,
        config: RunConfig,
        echo: Callable[[str], None],
        max_diff: float = 0.5,
        max_kl: float = 0.01,
        numerics: Numerics | None = None,
    ) -> None:
        """``numerics``: the run's (default: resolved for this machine)."""
        self.config = config
        self.numerics = numerics or resolve_numerics(config)
        self.echo = echo
        self.max_diff = max_diff
        self.max_kl = max_kl
        self.warned = False

    def observe(self, metrics: StepMetrics) -> None:
        if not self.config.on_policy:
            return
        diff = metrics.values.get(ROLLOUT_LOGPROB_DIFF_MAX, float("nan"))
        kl = metrics.values.get(ROLLOUT_MISMATCH_KL, float("nan"))
        if self.warned or not (diff > self.max_diff or kl > self.max_kl):
            return
        self.warned = True
        self.echo(
            f"warning: at step {metrics.step} the rollout's logprobs differ from the trainer's by up to {diff:.2f} "
            f"(mismatch KL {kl:.4f}): rollouts come from {engine_precision(self.config, self.numerics)}, the trainer "
            f"computes in {trainer_precision(self.numerics)}. The policy ratio then mixes two policies; "
            f"{mismatch_fixes(self.config, self.numerics)}"
        )


def mismatch_fixes(config: RunConfig, numerics: Numerics) -> str:
    """What would bring the engine's logprobs to the trainer's, naming only settings not already in force."""
    r, t = config.rollout, config.train
    engine_fp32 = (r.dtype or config.model.dtype) == "float32" and r.backend != "openai"
    fixes = []
    if r.backend in ("auto", "native") and not r.exact and config.model.lora is None:
        fixes.append(
            "set rollout.exact=true (with rollout.dtype=bfloat16 and train.precision=bf16_autocast, or both "
            "float32): engine and trainer then compute every logprob alike, bit for bit"
        )
    if r.exact:
        return (
            "rollout.exact is on, so engine and trainer should agree bit for bit: a gap means the weights "
            "differ (check the weight sync, rollout.kv_after_update=recompute) or samples lag the trainer"
        )
    if not engine_fp32:
        fixes.append(
            "start the servers with `postrl serve-rollout --dtype float32`"
            if r.backend == "openai"
            else "set rollout.dtype=float32"
        )
        if t.precision == "bf16_autocast":
            fixes[-1] += " and train.precision=float32"
        elif t.precision == "auto":
            fixes[-1] += " (and train.precision=float32 on a GPU)"
        fixes[-1] += " so both compute alike in float32"
        if t.precision != "bf16_autocast":
            fixes.append("train.precision=bf16_autocast brings the trainer closer to a bf16 engine")
    if numerics.proximal == "rollout":
        fixes.append("algorithm.old_logprobs=recompute corrects the gap with importance weights")
    if not fixes:
        return (
            "engine and trainer already compute in float32 and the gap is corrected by algorithm.importance; "
            "a larger gap than float32 rounding means their kernels or weights differ (check the weight sync)"
        )
    return "; or ".join(fixes)


class UpdateVisibilityWatch:
    """Warns once when most of an update stays in the float32 master weights because a bf16 engine's
    rounding cannot carry it (``train/update_visible_bf16`` below ``min_share``): the engine then
    samples from the policy of several steps ago, and learning looks stalled."""

    def __init__(
        self, config: RunConfig, echo: Callable[[str], None], min_share: float = 0.5, numerics: Numerics | None = None
    ) -> None:
        """``numerics``: the run's (default: resolved for this machine)."""
        self.config = config
        self.numerics = numerics or resolve_numerics(config)
        self.echo = echo
        self.min_share = min_share
        self.warned = False

    def observe(self, metrics: StepMetrics) -> None:
        share = metrics.values.get(TRAIN_UPDATE_VISIBLE_BF16, float("nan"))
        if self.warned or not self.numerics.samples_from_a_rounding or not share < self.min_share:
            return
        self.warned = True
        self.echo(
            f"warning: at step {metrics.step} only {share:.0%} of the update (train/update_visible_bf16) changed the "
            f"bf16 rounding of the weights at train.lr={self.config.train.lr:g}: {engine_precision(self.config, self.numerics)} "
            "samples with that rounding, so it keeps sampling from older weights until the changes add up. Set "
            "rollout.dtype=float32, or raise train.lr"
        )


def run_watches(config: RunConfig, echo: Callable[[str], None], numerics: Numerics | None = None) -> list[Watch]:
    """The run's watches (``numerics``: the run's, default resolved for this machine)."""
    numerics = numerics or resolve_numerics(config)
    source = "the reward function" if config.scores_with_components else "the environment's rewards (agent.env)"
    if isinstance(config.agent, FunctionAgent) and not config.scores_with_components:
        source = "the rewards your agent function returns (agent.function)"
    if isinstance(config.agent, VerifiersAgent):
        source = "the verifiers environment's rubric (agent.verifiers)"
    # a run that distils learns from its teachers whatever its rewards do
    no_signal = [NoSignalWatch(echo, source=source)] if config.algorithm.distill is None else []
    return [
        *no_signal,
        MismatchWatch(config, echo, numerics=numerics),
        UpdateVisibilityWatch(config, echo, numerics=numerics),
    ]


EXACT_MODE = (
    "exact mode (rollout.exact): the engine and the trainer compute every logprob alike, bit for bit; each step's "
    "line shows their largest difference (engine-trainer diff), 0 while the weights they hold are the same"
)


def describe_placement(config: RunConfig) -> str:
    """One line: where the train ranks, rollout engines and reward scoring run."""
    s, r = config.scheduler, config.rollout
    ray = s.type == "ray"
    where = f"Ray actors ({s.address or 'a local Ray instance'})" if ray else None
    if s.train.workers > 1:
        train = f"{s.train.workers} FSDP2 ranks as " + (where or "child processes")
    else:
        train = "1 rank " + ("as a Ray actor" if ray else "in this process")
    train += f", device {config.train.device}"
    if r.backend == "openai":
        rollout = f"servers at {r.url}"
    else:
        engines = s.rollout.workers
        if ray:
            place = "as Ray actors" if engines > 1 else "as a Ray actor"
        else:
            place = "in this process" if engines == 1 else "in child processes"
        rollout = f"{engines} {r.backend} engine{'s' if engines > 1 else ''} {place}"
        rollout += f", device {r.device}"
    if config.reward.remote is not None:
        reward = f"the Reward Service at {config.reward.remote.url}"
    else:
        n = config.reward.num_workers
        reward = f"{n} scoring process{'es' if n > 1 else ''}" + (" in the Reward Service actor" if ray else "")
    return f"workers: train {train}; rollout {rollout}; reward {reward}"
