"""Every field of every config model says what it is, and numbers carry their bounds."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from postrl.config.loading import build_config
from postrl.config.run import ConfigError, RewardServiceFile, RunConfig

# numeric fields that are unbounded on purpose
UNBOUNDED = {
    ("RunCommandConfig", "seed"): "any integer seeds the generators",
    ("_Component", "weight"): "a component may subtract from the reward",
    ("RewardConfig", "accuracy_threshold"): "rewards have no fixed scale",
    ("_Component", "expected_range"): "ranges of any scale",
}


def _models(root: type, seen: set[type]) -> None:
    if not (isinstance(root, type) and issubclass(root, BaseModel)) or root in seen:
        return
    seen.add(root)
    for field in root.model_fields.values():
        for inner in _flatten(field.annotation):
            _models(inner, seen)


def _flatten(annotation) -> list:
    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [a for arg in args for a in _flatten(arg)]


def _has_bounds(metadata) -> bool:
    return any(hasattr(m, b) for m in metadata for b in ("ge", "gt", "le", "lt"))


def _inner_bounds(annotation) -> bool:
    """Bounds on the items of a list or tuple: ``list[Annotated[int, Field(ge=0)]]``."""
    if typing.get_origin(annotation) is typing.Annotated:
        extras = typing.get_args(annotation)[1:]
        return any(_has_bounds(getattr(x, "metadata", [x])) for x in extras)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is dict and args and args[0] is str:  # names -> numbers: the numbers
        args = args[1:]
    return bool(args) and all(_inner_bounds(a) for a in args if a is not Ellipsis)


def _owner(model: type, name: str) -> str:
    for base in model.__mro__:
        if name in getattr(base, "__annotations__", {}):
            return base.__name__
    return model.__name__


def all_config_models() -> list[type]:
    seen: set[type] = set()
    for root in (RunConfig, RewardServiceFile):
        _models(root, seen)
    return sorted(seen, key=lambda m: m.__name__)


def test_config_models_are_found():
    names = {m.__name__ for m in all_config_models()}
    assert {
        "RunConfig",
        "RolloutConfig",
        "RewardConfig",
        "CodeComponent",
        "JudgeComponent",
        "SandboxConfig",
        "GRPOAdvantage",
        "PPOClipLoss",
        "AlgorithmConfig",
        "VLLMEngineConfig",
        "RewardServerConfig",
    } <= names


@pytest.mark.parametrize("model", all_config_models(), ids=lambda m: m.__name__)
def test_every_field_has_a_description_and_numbers_have_bounds(model):
    for name, field in model.model_fields.items():
        assert field.description and len(field.description) > 10, f"{model.__name__}.{name} has no description"
        numeric = {int, float} & set(_flatten(field.annotation))
        if numeric and (_owner(model, name), name) not in UNBOUNDED:
            assert _has_bounds(field.metadata) or _inner_bounds(field.annotation), (
                f"{model.__name__}.{name} is a number without bounds"
            )


def test_algorithm_entries_are_typed():
    config = build_config(
        {
            "algorithm": {
                "advantage": {"type": "grpo", "norm_by_std": False},
                "policy_loss": {"type": "ppo_clip", "clip_eps_high": 0.28},
            }
        }
    )
    assert config.algorithm.advantage.options() == {"norm_by_std": False, "eps": 1e-6, "std": "unbiased"}
    assert config.algorithm.policy_loss.options() == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": None}
    assert build_config({"algorithm": {"advantage": "grpo"}}).algorithm.advantage.norm_by_std is True
    with pytest.raises(ConfigError, match="unknown config field 'algorithm.norm_by_std' \\(allowed: advantage,"):
        build_config({"algorithm": {"norm_by_std": False}})
    with pytest.raises(ConfigError, match="clip_bound"):
        build_config({"algorithm": {"policy_loss": {"type": "ppo_clip", "clip_bound": 3}}})
    with pytest.raises(ConfigError, match="unknown policy loss 'dpo'; registered: cispo, gspo, ppo_clip, reinforce"):
        build_config({"algorithm": {"policy_loss": "dpo"}})
