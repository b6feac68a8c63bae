"""``postrl eval`` with sampling (``--n``), several sets, ``--json`` or ``--url``: which sets, which
engine, which reward; then the harness's table (:mod:`postrl.run.harness`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from postrl.config.data import NO_HELD_OUT
from postrl.config.reward import ACCURACY_KINDS
from postrl.config.rollout import RolloutConfig
from postrl.config.run import ConfigError, RewardConfig, RunConfig
from postrl.controller.batches import greedy_sampling
from postrl.controller.source import BatchSource
from postrl.data.dataset import PromptDataset, build_prompts, load_prompt_dataset
from postrl.data.prompt_source import prompt_source
from postrl.run.batch_sources import make_batch_source
from postrl.run.eval_metrics import default_ks
from postrl.run.harness import Harness, SetReport, table
from postrl.run.validation import load_eval_sets


def eval_sets(
    run_config: RunConfig | None, tokenizer: Any, task: str | None, data: list[str] | None, echo: Callable[[str], None]
) -> dict[str, PromptDataset]:
    """The sets to evaluate: ``--task``, ``--data``, else the config's held-out prompts (its prompt
    source's, :meth:`~postrl.data.prompt_source.PromptSource.held_out`) and each of its ``data.eval_sets``."""
    from postrl.tasks import task_rows

    if task:
        return {task: build_prompts(iter(task_rows(task, "test")), tokenizer)}
    if run_config is None:
        raise ConfigError("postrl eval needs what to evaluate on: --task NAME, --data FILE, --run or --config")
    source = prompt_source(run_config.data, tokenizer, run_config.agent)
    if data:
        return {", ".join(Path(f).name for f in data): load_prompt_dataset(data, tokenizer, **source.options())}
    sets: dict[str, PromptDataset] = {}
    held_out = source.held_out(echo)
    if held_out is not None:
        sets[source.held_out_name] = held_out
    sets.update(load_eval_sets(run_config, tokenizer, echo))
    if not sets:
        raise ConfigError(f"the config has no held-out prompts: {NO_HELD_OUT} (or pass --data FILE / --task NAME)")
    return sets


def task_reward(task: str) -> RewardConfig:
    """A built-in task scored by its own verifier (its name is a reward component type)."""
    from postrl.tasks import get_task

    return RewardConfig.model_validate({"components": [{"name": "correct", "type": get_task(task).verifier}]})


def run_harness(
    *,
    model: str,
    url: str | None,
    run_config: RunConfig | None,
    task: str | None,
    data: list[str] | None,
    n: int,
    ks: list[int] | None,
    temperature: float,
    top_p: float,
    max_tokens: int | None,
    as_json: bool,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate every set; print the table (or, with ``as_json``, one JSON object last) and return the JSON.
    An ``agent:`` run's answers are episodes of its environment or agent function, as in training."""
    from postrl.models.loading import load_tokenizer
    from postrl.reward.factory import make_reward_service

    ks = checked_ks(ks, n)
    tokenizer = load_tokenizer(model)
    reward = task_reward(task) if task else (run_config.reward if run_config else None)
    if reward is None:
        raise ConfigError("postrl eval needs a reward to score with: --task NAME, --run or --config")
    rollout = run_config.rollout if run_config else RolloutConfig()
    tokens = max_tokens or (rollout.max_tokens if run_config else 16)
    sets = eval_sets(run_config, tokenizer, task, data, echo if not as_json else lambda _: None)
    greedy = greedy_sampling(rollout, tokens)
    sampling = replace(greedy, n=n, temperature=temperature, top_p=top_p) if n > 1 else None
    agent = run_config.agent if run_config is not None else None
    engine = make_engine(model, url, tokenizer, rollout)
    service = make_reward_service(reward.model_copy(update={"num_workers": 1}))
    try:
        source = make_batch_source(agent, tokenizer, engine, service, model=model)
    except BaseException:
        service.close()
        engine.close()
        raise
    votes = agent is None or agent.reward == "service"
    try:
        harness = Harness(source, accuracy_component(source), reward.accuracy_threshold, greedy, sampling, votes)
        reports = [harness.report(name, dataset, ks) for name, dataset in sets.items()]
    finally:
        source.close()
        service.close()
        engine.close()
    result = summary(model if url is None else url, n, temperature, top_p, reports)
    if not as_json:
        echo(table(reports, ks, n if n > 1 else 0, votes))
    else:
        echo(json.dumps(result))
    return result


def checked_ks(ks: list[int] | None, n: int) -> list[int]:
    """The k of pass@k and maj@k: those asked (default: :func:`default_ks`), each in 1..n; none for n = 1."""
    chosen = sorted(set(ks or default_ks(n))) if n > 1 else []
    if chosen and (chosen[0] < 1 or chosen[-1] > n):
        raise ConfigError(f"--k {chosen}: every k must lie in 1..--n={n}")
    return chosen


def accuracy_component(source: BatchSource) -> str:
    """The reward component pass@k and maj@k count correct answers by; a ConfigError without one."""
    if source.accuracy_component is None:
        raise ConfigError(
            f"the reward has no accuracy component ({ACCURACY_KINDS}): pass@k and maj@k count correct answers"
        )
    return source.accuracy_component


def summary(model: str, n: int, temperature: float, top_p: float, reports: list[SetReport]) -> dict[str, Any]:
    return {
        "model": model,
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "sets": {r.name: r.as_json() for r in reports},
    }


def make_engine(model: str, url: str | None, tokenizer: Any, rollout: RolloutConfig) -> Any:
    """The run's engine over a model folder (fp32), or the OpenAI-compatible server at ``url``
    (``model`` then only gives the tokenizer that builds the prompts)."""
    if url is not None:
        from postrl.rollout.openai_remote import OpenAIRolloutWorker

        return OpenAIRolloutWorker(url, tokenizer, None, rollout.api_key_env)
    from postrl.models.loading import load_causal_lm
    from postrl.rollout.factory import rollout_worker_for_model

    return rollout_worker_for_model(rollout, load_causal_lm(model), tokenizer, "float32", seed=0)
