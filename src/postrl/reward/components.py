"""Reward component types, registered by name: how the Reward Service builds each type's scorer.

A *pooled* type names a function the killable scoring processes run (verifiers, custom functions,
code tests in the sandbox); a *local* type scores in the service's own process (rules, reward
models, judges). A *verifiable* type's value says whether an answer is correct: the first such
component is the run's ``accuracy``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from postrl.config.reward import RewardComponentConfig
from postrl.config.run import ConfigError
from postrl.reward.rules import format_reward, length_penalty, overlong_penalty
from postrl.reward.verifiers import VERIFIERS
from postrl.types import Score, ScoreRequest

CODE_REWARD = "postrl.reward.code:code_reward"
GYM_REWARD = "postrl.reward.reasoning_gym:score"
LocalScorer = Callable[[list[ScoreRequest]], list[Score]]


@dataclass(frozen=True)
class PooledScorer:
    """A ``module:function`` the scoring processes import and call per sample, with its options."""

    function: str
    options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0


class BuildContext(Protocol):
    """What a component's builder may ask of the service that builds it."""

    @property
    def default_timeout_s(self) -> float: ...

    def sandbox_options(self) -> dict[str, Any]:
        """The code sandbox's protections, probed once per service."""
        ...

    def on_close(self, close: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class ComponentType:
    build: Callable[[Any, BuildContext], PooledScorer | LocalScorer]
    pooled: bool
    verifiable: bool


COMPONENT_TYPES: dict[str, ComponentType] = {}


def register_component_type(name: str, *, pooled: bool, verifiable: bool = False) -> Callable:
    def decorator(build: Callable) -> Callable:
        if name in COMPONENT_TYPES:
            raise ValueError(f"reward component type '{name}' is already registered")
        COMPONENT_TYPES[name] = ComponentType(build, pooled, verifiable)
        return build

    return decorator


def component_type(comp: RewardComponentConfig) -> ComponentType:
    if comp.type not in COMPONENT_TYPES:
        raise ValueError(f"reward component {comp.name}: unknown type '{comp.type}'")
    return COMPONENT_TYPES[comp.type]


def accuracy_component(components: list[tuple[str, str, bool]]) -> str | None:
    """The component whose value counts as correct, of ``(name, type, marked)`` triples: the one
    marked ``accuracy: true``, else the first verifiable one (exact_match, math), else none."""
    marked = next((name for name, _, flag in components if flag), None)
    return marked or next(
        (name for name, kind, _ in components if kind in COMPONENT_TYPES and COMPONENT_TYPES[kind].verifiable), None
    )


def _verifier(comp: Any, ctx: BuildContext) -> PooledScorer:
    return PooledScorer(
        VERIFIERS[comp.type], {"answer_column": comp.answer_column}, comp.timeout_s or ctx.default_timeout_s
    )


register_component_type("exact_match", pooled=True, verifiable=True)(_verifier)
register_component_type("math", pooled=True, verifiable=True)(_verifier)


@register_component_type("reasoning_gym", pooled=True, verifiable=True)
def _reasoning_gym(comp: Any, ctx: BuildContext) -> PooledScorer:
    return PooledScorer(GYM_REWARD, {"scorer": comp.scorer}, comp.timeout_s or ctx.default_timeout_s)


@register_component_type("custom", pooled=True)
def _custom(comp: Any, ctx: BuildContext) -> PooledScorer:
    check_importable(comp.function)
    return PooledScorer(comp.function, {}, comp.timeout_s or ctx.default_timeout_s)


@register_component_type("code", pooled=True)
def _code(comp: Any, ctx: BuildContext) -> PooledScorer:
    options = {
        "tests_column": comp.tests_column,
        "code_score": comp.code_score,
        "sandbox": comp.sandbox.model_dump(),
        "protections": ctx.sandbox_options(),  # the workers use this probe instead of repeating it
    }
    return PooledScorer(CODE_REWARD, options, comp.timeout_s or comp.sandbox.wall_s + comp.timeout_margin_s)


@register_component_type("format", pooled=False)
def _format(comp: Any, ctx: BuildContext) -> LocalScorer:
    pattern = re.compile(comp.pattern, re.DOTALL)
    return lambda reqs: [(format_reward(pattern, r.response), None) for r in reqs]


@register_component_type("length", pooled=False)
def _length(comp: Any, ctx: BuildContext) -> LocalScorer:
    return lambda reqs: [(length_penalty(r.response_tokens, comp.target_tokens), None) for r in reqs]


@register_component_type("overlong", pooled=False)
def _overlong(comp: Any, ctx: BuildContext) -> LocalScorer:
    return lambda reqs: [(overlong_penalty(r.response_tokens, comp.max_tokens, comp.cache_tokens), None) for r in reqs]


@register_component_type("reward_model", pooled=False)
def _reward_model(comp: Any, ctx: BuildContext) -> LocalScorer:
    from postrl.reward.reward_model import RewardModel

    model = RewardModel(comp.path, comp.batch_size)
    return lambda reqs: [(s, None) for s in model.score([(r.prompt, r.response) for r in reqs])]


@register_component_type("remote_reward_model", pooled=False)
def _remote_reward_model(comp: Any, ctx: BuildContext) -> LocalScorer:
    from postrl.reward.remote_scorers import RemoteRewardModel

    remote = RemoteRewardModel(comp.url, comp.timeout_s or comp.request_timeout_s, comp.api_key_env)
    ctx.on_close(remote.close)
    return lambda reqs: remote.score([(r.prompt, r.response) for r in reqs])


@register_component_type("judge", pooled=False)
def _judge(comp: Any, ctx: BuildContext) -> LocalScorer:
    from postrl.reward.remote_scorers import LLMJudge

    judge = LLMJudge(
        comp.url,
        comp.model,
        comp.prompt_template,
        comp.score_pattern,
        comp.score_scale,
        comp.timeout_s or comp.request_timeout_s,
        comp.api_key_env,
        comp.max_concurrency,
    )
    ctx.on_close(judge.close)
    return lambda reqs: judge.score([(r.prompt, r.response, r.columns) for r in reqs])


def check_importable(path: str) -> None:
    """Fail at start-up, not at the first step, when the reward function cannot be imported."""
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"reward function '{path}': cannot import module '{module_name}': {exc}") from None
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"reward function '{path}': module '{module_name}' has no callable '{attr}'")
