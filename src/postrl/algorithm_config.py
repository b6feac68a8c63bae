"""The algorithm section of a config, typed per entry: GRPO's options belong to GRPO, the clip
bounds to the clipped loss. ``advantage: grpo`` is short for ``advantage: {type: grpo}``; an entry
registered by a plugin module takes its keyword arguments in ``options``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from postrl.config_base import Section


def _shorthand(value: Any) -> Any:
    return {"type": value} if isinstance(value, str) else value


def _kind(builtin: str) -> Any:
    """Pick the built-in model for ``builtin``, the plugin model for any other registered name."""

    def pick(value: Any) -> str:
        value = _shorthand(value)
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return "builtin" if kind == builtin else "plugin"

    return Discriminator(pick)


class GRPOAdvantage(Section):
    type: Literal["grpo"] = Field(description="Group-relative: (r - mean of its group) / (std of its group + eps).")
    norm_by_std: bool = Field(True, description="Divide by the group's (unbiased) reward std; false: Dr.GRPO-style "
                              "mean-centering only.")
    eps: float = Field(1e-6, gt=0.0, description="Added to the group std before dividing.")

    def options(self) -> dict[str, Any]:
        return {"norm_by_std": self.norm_by_std, "eps": self.eps}


class PPOClipLoss(Section):
    type: Literal["ppo_clip"] = Field(description="PPO's clipped surrogate, per token.")
    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0, description="The ratio is clipped below at 1 - clip_eps_low.")
    clip_eps_high: float = Field(0.2, ge=0.0, description="The ratio is clipped above at 1 + clip_eps_high.")

    def options(self) -> dict[str, Any]:
        return {"clip_eps_low": self.clip_eps_low, "clip_eps_high": self.clip_eps_high}


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


AdvantageConfig = Annotated[
    Union[Annotated[GRPOAdvantage, Tag("builtin")], Annotated[PluginAdvantage, Tag("plugin")]], _kind("grpo")]
PolicyLossConfig = Annotated[
    Union[Annotated[PPOClipLoss, Tag("builtin")], Annotated[PluginLoss, Tag("plugin")]], _kind("ppo_clip")]
MOVED = {"norm_by_std": "advantage", "clip_eps_low": "policy_loss", "clip_eps_high": "policy_loss"}


class AlgorithmConfig(Section):
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules imported before the names below are looked up, so that their @register_advantage, "
        "@register_policy_loss and @register_loss_aggregation entries exist (a module next to the config imports "
        "as is; see import_paths).")
    advantage: AdvantageConfig = Field(  # type: ignore[valid-type]
        default_factory=lambda: GRPOAdvantage(type="grpo"), description="The advantage estimator and its options.")
    policy_loss: PolicyLossConfig = Field(  # type: ignore[valid-type]
        default_factory=lambda: PPOClipLoss(type="ppo_clip"), description="The policy loss and its options.")
    loss_agg: str = Field("token_mean", description="Loss aggregation (registry name).")
    kl_beta: float = Field(0.0, ge=0.0, description="KL-to-reference coefficient; 0 loads no reference model.")

    @model_validator(mode="before")
    @classmethod
    def _typed_entries(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        moved = sorted(k for k in MOVED if k in data)
        if moved:
            where = ", ".join(f"algorithm.{MOVED[k]}.{k}" for k in moved)
            raise ValueError(f"algorithm.{', algorithm.'.join(moved)} moved into the entry they belong to: write "
                             f"{where} (e.g. advantage: {{type: grpo, norm_by_std: false}})")
        data = dict(data)
        for key in ("advantage", "policy_loss"):
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

    @field_validator("loss_agg")
    @classmethod
    def _known_agg(cls, v: str) -> str:
        from postrl.algorithms import LOSS_AGGREGATIONS

        return LOSS_AGGREGATIONS.check(v)
