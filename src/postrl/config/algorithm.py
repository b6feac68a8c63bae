"""The algorithm section of a config, typed per entry: GRPO's options belong to GRPO, the clip
bounds to the clipped loss. ``advantage: grpo`` is short for ``advantage: {type: grpo}``; an entry
registered by a plugin module takes its keyword arguments in ``options``."""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from postrl.config.base import Section
from postrl.config.distill import DistillConfig


def _shorthand(value: Any) -> Any:
    return {"type": value} if isinstance(value, str) else value


def _kind(members: Any) -> Any:
    """Pick the member of the tagged union ``members`` named by ``type`` (its ``Tag``), the plugin
    model for any other registered name: the built-in names are the union's own tags."""
    builtins = {m.tag for arg in typing.get_args(members) for m in typing.get_args(arg)[1:] if isinstance(m, Tag)}
    builtins.discard("plugin")

    def pick(value: Any) -> str:
        value = _shorthand(value)
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return kind if kind in builtins else "plugin"

    return Discriminator(pick)


class _Entry(Section):
    def options(self) -> dict[str, Any]:
        return self.model_dump(exclude={"type"})


class GRPOAdvantage(_Entry):
    type: Literal["grpo"] = Field(description="Group-relative: (r - mean of its group) / (std of its group + eps).")
    norm_by_std: bool = Field(
        True, description="Divide by the group's reward std; false: Dr.GRPO-style mean-centering only."
    )
    eps: float = Field(1e-6, gt=0.0, description="Added to the group std before dividing (verl: 1e-6, TRL: 1e-4).")
    std: Literal["unbiased", "biased"] = Field(
        "unbiased", description="The group std: unbiased (n-1, as torch, verl and TRL) or biased (n)."
    )


class UnitAdvantage(_Entry):
    type: Literal["unit"] = Field(
        description="Advantage 1 for every scored sample, whatever its reward: with policy_loss reinforce, the "
        "negative log-likelihood (what postrl sft trains)."
    )


class DrGRPOAdvantage(_Entry):
    type: Literal["dr_grpo"] = Field(description="Dr. GRPO: r - mean of its group (no std division).")


class RLOOAdvantage(_Entry):
    type: Literal["rloo"] = Field(description="RLOO: r - mean of the other samples of its group.")


class ReinforcePPAdvantage(_Entry):
    type: Literal["reinforce_pp", "reinforce_pp_baseline"] = Field(
        description="REINFORCE++: per-token discounted returns normalised over the batch; _baseline subtracts the "
        "group mean reward first."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount per token.")
    eps: float = Field(1e-8, gt=0.0, description="Added to the batch std before dividing.")


class ReMaxAdvantage(_Entry):
    type: Literal["remax"] = Field(
        description="ReMax: r - the reward of the prompt's greedy response (generated and scored in the same step)."
    )


class GAEAdvantage(_Entry):
    type: Literal["gae"] = Field(description="GAE over the response tokens with the critic's values (PPO).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount per token.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE's lambda: 1 = Monte-Carlo returns, 0 = one-step TD.")
    whiten: bool = Field(
        True,
        description="Normalise the advantages over the batch's response tokens (mean 0, variance 1), as verl and "
        "OpenRLHF do; the critic's targets use the raw advantages. false: the raw GAE advantages.",
    )


class CriticConfig(Section):
    path: str | None = Field(
        None,
        description="The value model's backbone (a causal LM folder or id); None: a copy "
        "of the policy's starting weights. A scalar head is added, initialised to 0.",
    )
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate of the critic.")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="PPO value clipping around the values at rollout time; None: the plain squared error."
    )
    warmup_steps: int = Field(
        0, ge=0, description="The first k steps train only the critic (the policy waits for values worth a baseline)."
    )
    epochs: int = Field(1, ge=1, description="Passes (optimizer steps) of the critic per RL step.")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per critic forward/backward.")
    grad_clip: float = Field(1.0, gt=0.0, description="The critic's gradient norm clip.")


class PPOClipLoss(_Entry):
    type: Literal["ppo_clip"] = Field(description="PPO's clipped surrogate, per token.")
    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0, description="The ratio is clipped below at 1 - clip_eps_low.")
    clip_eps_high: float = Field(
        0.2, ge=0.0, description="The ratio is clipped above at 1 + clip_eps_high (DAPO's clip-higher: 0.28)."
    )
    dual_clip_c: float | None = Field(
        None,
        gt=1.0,
        description="Dual clip: the loss of a negative-advantage token is "
        "at most c * |A| (3 in the paper). Off by default: it matters only far "
        "off-policy, and postrl's default is one on-policy epoch.",
    )


class GSPOLoss(_Entry):
    type: Literal["gspo"] = Field(description="GSPO: one length-normalised importance ratio per sequence, clipped.")
    clip_eps_low: float = Field(3e-4, ge=0.0, le=1.0, description="Lower clip of the sequence ratio.")
    clip_eps_high: float = Field(4e-4, ge=0.0, description="Upper clip of the sequence ratio.")


class CISPOLoss(_Entry):
    type: Literal["cispo"] = Field(description="CISPO: REINFORCE weighted by the clipped, stop-gradient ratio.")
    clip_eps_low: float = Field(1.0, ge=0.0, le=1.0, description="Lower clip of the weight (1: none).")
    clip_eps_high: float = Field(0.28, ge=0.0, description="Upper clip of the weight.")


class ReinforceLoss(_Entry):
    type: Literal["reinforce"] = Field(description="Plain REINFORCE: -A log pi, no ratio, no clip (on-policy).")


class _PluginEntry(Section):
    type: str = Field(description="The name a plugin module registered (see algorithm.plugins).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the function.")

    def options(self) -> dict[str, Any]:
        return dict(self.params)


class PluginAdvantage(_PluginEntry):
    @field_validator("type")
    @classmethod
    def _registered(cls, v: str) -> str:
        from postrl.algorithms import ADVANTAGES

        return ADVANTAGES.check(v)


class PluginLoss(_PluginEntry):
    @field_validator("type")
    @classmethod
    def _registered(cls, v: str) -> str:
        from postrl.algorithms import POLICY_LOSSES

        return POLICY_LOSSES.check(v)


class PluginCorrection(_PluginEntry):
    @field_validator("type")
    @classmethod
    def _registered(cls, v: str) -> str:
        from postrl.algorithms import IMPORTANCE_CORRECTIONS

        return IMPORTANCE_CORRECTIONS.check(v)


_Advantages = (
    Annotated[GRPOAdvantage, Tag("grpo")]
    | Annotated[DrGRPOAdvantage, Tag("dr_grpo")]
    | Annotated[UnitAdvantage, Tag("unit")]
    | Annotated[RLOOAdvantage, Tag("rloo")]
    | Annotated[ReinforcePPAdvantage, Tag("reinforce_pp")]
    | Annotated[ReinforcePPAdvantage, Tag("reinforce_pp_baseline")]
    | Annotated[ReMaxAdvantage, Tag("remax")]
    | Annotated[GAEAdvantage, Tag("gae")]
    | Annotated[PluginAdvantage, Tag("plugin")]
)
AdvantageConfig = Annotated[_Advantages, _kind(_Advantages)]
_PolicyLosses = (
    Annotated[PPOClipLoss, Tag("ppo_clip")]
    | Annotated[GSPOLoss, Tag("gspo")]
    | Annotated[CISPOLoss, Tag("cispo")]
    | Annotated[ReinforceLoss, Tag("reinforce")]
    | Annotated[PluginLoss, Tag("plugin")]
)
PolicyLossConfig = Annotated[_PolicyLosses, _kind(_PolicyLosses)]


class _BoundedCorrection(_Entry):
    low: float
    high: float

    level: Literal["token", "sequence"] = Field(
        "token", description="One ratio per token, or one per sequence (the product of its tokens' ratios)."
    )

    def options(self) -> dict[str, Any]:
        return {"level": self.level, "low": self.low, "high": self.high}


class TISCorrection(_BoundedCorrection):
    type: Literal["tis"] = Field(
        description="Truncated importance sampling: each token's weight is the ratio pi_prox / pi_behav clipped to "
        "[low, high] (low 0: Yao et al.'s min(ratio, high))."
    )
    low: float = Field(0.0, ge=0.0, le=1.0, description="Lower clip of the ratio.")
    high: float = Field(2.0, ge=1.0, description="Upper clip of the ratio.")


class MISCorrection(_BoundedCorrection):
    type: Literal["mis"] = Field(
        description="Masked importance sampling: the ratio where it lies in [low, high]; outside, the token (or with "
        "level: sequence the sequence) leaves the gradient."
    )
    low: float = Field(0.5, ge=0.0, le=1.0, description="A ratio below this rejects the token (or sequence).")
    high: float = Field(2.0, ge=1.0, description="A ratio above this rejects the token (or sequence).")


class NoCorrection(_Entry):
    type: Literal["none"] = Field(description="Weight 1 on every token: the engine is taken to be the proximal policy.")


_Corrections = (
    Annotated[TISCorrection, Tag("tis")]
    | Annotated[MISCorrection, Tag("mis")]
    | Annotated[NoCorrection, Tag("none")]
    | Annotated[PluginCorrection, Tag("plugin")]
)
ImportanceCorrectionConfig = Annotated[_Corrections, _kind(_Corrections)]


# the built-in loss aggregations (postrl.algorithms.losses); a plugin's registered name is also accepted
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


class StageEntry(Section):
    type: str = Field(description="The stage's registered name (postrl.algorithms.register_stage).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the stage's factory.")


# algorithm.old_logprobs resolved (train.factory.old_logprobs_source): where the proximal policy comes from
ProximalSource = Literal["recompute", "approximate", "rollout"]


class AlgorithmConfig(Section):
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules imported before the names below are looked up, so that their @register_advantage, "
        "@register_policy_loss and @register_loss_aggregation entries exist (a module next to the config imports "
        "as is; see import_paths).",
    )
    advantage: AdvantageConfig = Field(  # type: ignore[valid-type]
        default_factory=lambda: GRPOAdvantage(type="grpo"), description="The advantage estimator and its options."
    )
    policy_loss: PolicyLossConfig = Field(  # type: ignore[valid-type]
        default_factory=lambda: PPOClipLoss(type="ppo_clip"), description="The policy loss and its options."
    )
    loss_agg: LossAggregation | str = Field(
        "token_mean",
        description="How the per-token losses of a mini-batch become one: token_mean (every trained token weighs the "
        "same), seq_mean_token_mean (every sequence the same), seq_mean_token_sum, seq_mean_token_sum_norm (Dr. GRPO: "
        "token sums over a constant), or a name a plugin module registered with @register_loss_aggregation.",
    )
    kl_beta: float = Field(0.0, ge=0.0, description="KL-to-reference coefficient; 0 loads no reference model.")
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = Field(
        "k3",
        description="KL(pi || ref) per token: k1 log-ratio, k2 half squared log-ratio, k3 exp(-x) + x - 1 "
        "(Schulman), abs |log-ratio| (verl's 'abs').",
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="Where the KL to the reference goes: a term of the "
        "loss, or a per-token penalty -beta x KL in the reward (token-level "
        "estimators: reinforce_pp, reinforce_pp_baseline, gae).",
    )
    kl_target: float | None = Field(
        None,
        gt=0.0,
        description="Adapt kl_beta towards this KL per token (Ziegler et "
        "al. 2019), starting from kl_beta; None: a fixed coefficient.",
    )
    kl_horizon: int = Field(10000, ge=1, description="The adaptive controller's horizon, in samples.")
    kl_clamp: float | None = Field(
        None, gt=0.0, description="Clamp the per-token KL to [-c, c] (verl's low-variance KL uses 10); None: no clamp."
    )
    critic: CriticConfig | None = Field(None, description="PPO's value model (with advantage: gae); None: no critic.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop groups whose scorable rewards are all equal (they "
        "teach nothing) and sample more prompts until prompts_per_step groups remain.",
    )
    max_extra_rounds: int = Field(
        3,
        ge=0,
        description="dynamic_sampling: at most this many extra generate rounds per "
        "step; a step that still lacks groups trains on those it has.",
    )
    stages: list[StageEntry] = Field(
        default_factory=list,
        description="Stages from your own modules (registered with postrl.algorithms.register_stage in a module "
        "of plugins), run after the built-in ones in the order listed.",
    )
    distill: DistillConfig | None = Field(
        None,
        description="On-policy distillation: each sampled token's advantage gains weight x (teacher logprob - "
        "student logprob), the per-token reverse KL's negative; {teacher: PATH_OR_URL} for one teacher, or "
        "teachers: [...] with applies_to per task. None: off.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Entropy bonus: the loss minus coef x the policy's per-token entropy (0: off)."
    )
    old_logprobs: Literal["auto", "recompute", "approximate", "rollout"] = Field(
        "auto",
        description="The 'old' policy of the loss's ratio: recompute (the trainer's own logprobs before the update: "
        "the proximal policy of decoupled PPO, with the engine's gap corrected by `importance`), approximate (A-3PO: "
        "the proximal logprobs interpolated between the engine's and the current policy's by weight version, "
        "without recompute's extra forward; the first mini-batch's are exact) or rollout (the engine's logprobs as "
        "they came). auto: recompute unless engine and trainer compute alike in float32 on the same weights (a "
        "sync run with the native or hf engine).",
    )
    importance: ImportanceCorrectionConfig = Field(  # type: ignore[valid-type]
        default_factory=lambda: TISCorrection(type="tis"),
        description="The behaviour/proximal importance-sampling correction (with old_logprobs recompute or "
        "approximate).",
    )
    max_token_lag: int | None = Field(
        None,
        ge=0,
        description="Tokens produced by weights more than this many versions older than the trainer's are left "
        "out of the loss (counted in buffer/lag_masked_tokens); None: none are.",
    )

    @model_validator(mode="before")
    @classmethod
    def _typed_entries(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in ("advantage", "policy_loss", "importance"):
            if key in data:
                data[key] = _shorthand(data[key])
        return data

    @field_validator("plugins")
    @classmethod
    def _import_plugins(cls, modules: list[str]) -> list[str]:
        import importlib

        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                raise ValueError(f"algorithm.plugins: cannot import '{name}': {exc}") from None
        return modules

    @model_validator(mode="after")
    def _kl_settings_fit(self) -> AlgorithmConfig:
        if self.kl_target is not None and self.kl_beta <= 0:
            raise ValueError("algorithm.kl_target adapts kl_beta from its starting value: set kl_beta > 0")
        if self.kl_in == "reward" and self.kl_beta <= 0:
            raise ValueError("algorithm.kl_in=reward puts -kl_beta x KL in the reward: set kl_beta > 0")
        from postrl.algorithms import ADVANTAGES

        token_level = ADVANTAGES.names_needing(lambda needs: needs.token_level)
        if self.kl_in == "reward" and not ADVANTAGES.needs(self.advantage.type).token_level:
            raise ValueError(
                f"algorithm.kl_in=reward puts a per-token penalty into the rewards, which "
                f"advantage={self.advantage.type} does not take (it uses one reward per sample); use "
                f"kl_in=loss, or one of {', '.join(token_level)}"
            )
        return self

    @model_validator(mode="after")
    def _values_and_critic_go_together(self) -> AlgorithmConfig:
        from postrl.algorithms import ADVANTAGES

        wants_values = ADVANTAGES.needs(self.advantage.type).values
        if wants_values and self.critic is None:
            raise ValueError(
                f"algorithm.advantage={self.advantage.type} needs a critic: set algorithm.critic (e.g. critic: {{lr: 1e-4}})"
            )
        if self.critic is not None and not wants_values:
            users = ", ".join(ADVANTAGES.names_needing(lambda needs: needs.values))
            raise ValueError(f"algorithm.critic is only used by advantage={users}, not {self.advantage.type}")
        return self

    @model_validator(mode="after")
    def _known_stages(self) -> AlgorithmConfig:
        from postrl.algorithms.stages import STAGES

        for i, entry in enumerate(self.stages):
            try:
                STAGES.check(entry.type)
            except ValueError as exc:
                raise ValueError(
                    f"algorithm.stages[{i}]: {exc} (register it in a module of algorithm.plugins)"
                ) from None
        return self

    @model_validator(mode="after")
    def _importance_needs_a_proximal_policy(self) -> AlgorithmConfig:
        if self.old_logprobs == "rollout" and "importance" in self.model_fields_set and self.importance.type != "none":
            raise ValueError(
                f"algorithm.importance={self.importance.type} corrects the engine's logprobs towards the trainer's "
                "recomputed ones, but algorithm.old_logprobs=rollout uses the engine's directly: set "
                "old_logprobs=recompute (or importance: none)"
            )
        return self

    @property
    def needs_reference(self) -> bool:
        """A KL to the reference model (in the loss or in the reward) needs the reference model loaded."""
        return self.kl_beta > 0

    @field_validator("loss_agg")
    @classmethod
    def _known_agg(cls, v: str) -> str:
        from postrl.algorithms import LOSS_AGGREGATIONS

        return LOSS_AGGREGATIONS.check(v)
