"""Settings a config leaves to postrl, decided once at start-up, without changing the config: a run
uses a copy with them (:func:`resolved_run`), and that copy is what its ``config.yaml`` records,
so a resume keeps them.

- ``data.max_prompt_tokens`` (unset): the room the model's context leaves after
  ``rollout.max_tokens`` (an ``agent:`` run: ``agent.max_context - 1``);
- ``rollout.vllm.max_model_len`` (unset, ``backend: vllm``): what the run needs, prompt budget
  plus response tokens;
- ``train.lr_decay_steps`` (unset, a decaying schedule): the run's length in optimizer steps.

Prompts and responses that cannot fit the model's context are refused here, before any work.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from postrl.config.run import ConfigError, RunConfig
from postrl.config.training import OptimizerConfig
from postrl.data.dataset import DEFAULT_MAX_PROMPT_TOKENS
from postrl.models.loading import context_length

C = TypeVar("C")


def with_settings(config: C, settings: dict[str, Any]) -> C:
    """A copy of ``config`` (a pydantic model) with ``settings`` (dotted field -> value) set."""
    copy = config.model_copy(deep=True)  # type: ignore[attr-defined]
    for dotted, value in settings.items():
        *path, name = dotted.split(".")
        section = copy
        for part in path:
            section = getattr(section, part)
        setattr(section, name, value)  # validated (assignments are)
    return copy


def resolved_run(config: RunConfig) -> RunConfig:
    """The config a ``postrl train`` run uses (see the module docstring); ``config`` is left as it is."""
    settings = context_settings(config)
    settings |= decay_settings(config.train, run_optimizer_steps(config))
    return with_settings(config, settings) if settings else config


def context_settings(config: RunConfig) -> dict[str, Any]:
    """``data.max_prompt_tokens`` and ``rollout.vllm.max_model_len`` where unset; raises when the
    prompts and responses cannot fit the model's context."""
    limit = context_length(config.model.path)
    prompt, settings = config.data.max_prompt_tokens, dict[str, Any]()
    response = config.rollout.max_tokens
    if config.agent is not None:  # an episode's first prompt only has to leave room for a turn
        if prompt is None:
            prompt = settings["data.max_prompt_tokens"] = config.agent.max_context - 1
        if limit is not None and config.agent.max_context > limit:
            raise ConfigError(
                f"agent.max_context={config.agent.max_context} is more than the model's context length {limit} "
                f"({config.model.path})"
            )
    elif prompt is None:
        if limit is not None and limit <= response:
            raise ConfigError(
                f"rollout.max_tokens={response} leaves no room for a prompt in the model's context length "
                f"{limit} ({config.model.path})"
            )
        prompt = settings["data.max_prompt_tokens"] = DEFAULT_MAX_PROMPT_TOKENS if limit is None else limit - response
    elif limit is not None and prompt + response > limit:
        raise ConfigError(
            f"data.max_prompt_tokens={prompt} + rollout.max_tokens={response} = {prompt + response} is more "
            f"than the model's context length {limit} ({config.model.path}); lower one of them"
        )
    if config.rollout.backend == "vllm":
        settings |= vllm_settings(config, prompt + response, limit)
    return settings


def vllm_settings(config: RunConfig, needed: int, limit: int | None) -> dict[str, Any]:
    """vLLM refuses a max_model_len over the model's context only after its slow start-up: decide it
    here. Unset, it is what the run needs (prompt budget plus response tokens)."""
    asked = config.rollout.vllm.max_model_len
    if asked is None:
        return {"rollout.vllm.max_model_len": needed}
    if limit is not None and asked > limit:
        raise ConfigError(
            f"rollout.vllm.max_model_len={asked} is more than the model's context length {limit} "
            f"({config.model.path}); leave it unset (the run needs {needed}) or lower it"
        )
    if asked < needed:
        raise ConfigError(
            f"rollout.vllm.max_model_len={asked} is less than data.max_prompt_tokens + rollout.max_tokens = "
            f"{needed}; raise it or leave it unset"
        )
    return {}


def run_optimizer_steps(config: RunConfig) -> int:
    """A ``postrl train`` run's optimizer steps: steps x mini-batches per step x epochs."""
    t = config.train
    return config.steps * math.ceil(config.prompts_per_step * config.rollout.n / t.mini_batch_size) * t.epochs


def decay_settings(train: OptimizerConfig, optimizer_steps: int) -> dict[str, Any]:
    """An unset ``train.lr_decay_steps`` of a decaying schedule: the run's optimizer steps."""
    if train.lr_schedule != "constant" and train.lr_decay_steps is None:
        return {"train.lr_decay_steps": optimizer_steps}
    return {}
