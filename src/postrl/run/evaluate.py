"""Held-out evaluation: greedy responses to a built-in task's test split or to the user's own
prompt file, scored by the task's verifier or by a run's own reward components."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.config.loading import load_config
from postrl.config.rollout import RolloutConfig
from postrl.config.run import ConfigError, RewardConfig, RunConfig
from postrl.controller.batches import greedy_sampling
from postrl.data.dataset import PromptDataset, build_prompts, load_prompt_dataset
from postrl.data.prompt_source import prompt_source
from postrl.reward.accuracy import accuracy
from postrl.reward.verifiers import VERIFIERS
from postrl.reward.worker import resolve
from postrl.rollout.common import generate_shown
from postrl.rollout.factory import rollout_worker_for_model
from postrl.tasks import get_task, task_rows
from postrl.types import Rollout
from postrl.workers.net import can_connect, url_endpoint

DEFAULT_TASK = "arithmetic"  # what `postrl eval --model DIR` measures with no --task, --data or run: the demo's task


@dataclass
class EvalResult:
    """A built-in task's held-out accuracy (its verifier's)."""

    task: str
    accuracy: float
    correct: int
    total: int


@dataclass
class ScoredEval:
    """Held-out prompts scored by a run's reward components."""

    name: str
    accuracy: float | None  # None: no reward component is an accuracy (see postrl.reward.accuracy)
    correct: int
    total: int
    mean_reward: float | None
    unscorable: int


def greedy_rollouts(
    model: torch.nn.Module, tokenizer: Any, dataset: PromptDataset, max_tokens: int, rollout: RolloutConfig
) -> list[Rollout]:
    """One greedy answer per prompt from the engine training generates with (``rollout``: the run's
    section; the native engine for a Llama-family model, in its dtype), with the run's stops."""
    engine = rollout_worker_for_model(rollout, model, tokenizer, "float32", seed=0)
    was_training = model.training
    try:
        return generate_shown(engine, dataset.prompts, greedy_sampling(rollout, max_tokens), 0)
    finally:
        engine.close()
        model.train(was_training)


def evaluate_model(
    model: torch.nn.Module, tokenizer: Any, task: str, max_tokens: int = 16, rollout: RolloutConfig | None = None
) -> EvalResult:
    """A built-in task's test split, scored by its verifier (``rollout``: the run's section, else the default)."""
    dataset = build_prompts(iter(task_rows(task, "test")), tokenizer)
    verifier = resolve(VERIFIERS[get_task(task).verifier])
    rollouts = greedy_rollouts(model, tokenizer, dataset, max_tokens, rollout or RolloutConfig())
    correct = sum(
        verifier(dataset[r.prompt_index].text, r.text, **dataset[r.prompt_index].columns) >= 1.0 for r in rollouts
    )
    return EvalResult(task=task, accuracy=correct / len(rollouts), correct=int(correct), total=len(rollouts))


def evaluate_with_rewards(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: PromptDataset,
    reward: RewardConfig,
    rollout: RolloutConfig,
    max_tokens: int,
    name: str,
    out: Path | None = None,
) -> ScoredEval:
    """Greedy responses from the engine training generates with, scored by ``reward``'s components
    through the same batch source training uses; accuracy is :func:`postrl.reward.accuracy.accuracy`
    (None without an accuracy component)."""
    from postrl.controller.source import SingleTurn
    from postrl.controller.step_metrics import write_samples
    from postrl.reward.factory import make_reward_service

    engine = rollout_worker_for_model(rollout, model, tokenizer, "float32", seed=0)
    service = make_reward_service(reward)
    was_training = model.training
    try:
        source = SingleTurn(engine, service)
        rollouts = source.generate(dataset.prompts, greedy_sampling(rollout, max_tokens), 0)
        results = source.score(dataset.prompts, rollouts)
        component = source.accuracy_component
    finally:
        service.close()
        engine.close()
        model.train(was_training)
    if out is not None:
        write_samples(out, dataset.prompts, rollouts, results)
    acc = accuracy(results, component, reward.accuracy_threshold)
    scored = [res.reward for res in results if res.reward is not None]
    return ScoredEval(
        name=name,
        accuracy=acc,
        correct=round((acc or 0.0) * len(results)),
        total=len(results),
        mean_reward=sum(scored) / len(scored) if scored else None,
        unscorable=len(results) - len(scored),
    )


def run_model_path(run_dir: Path) -> str:
    """A run's trained model: ``final_model/``, else the newest checkpoint's model folder."""
    from postrl.run.checkpoint import latest_checkpoint

    if (run_dir / "final_model" / "config.json").is_file():
        return str(run_dir / "final_model")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError(f"{run_dir} has neither final_model/ nor a complete checkpoint to evaluate")
    return str(checkpoint / "model")


def _is_offline_run(run: str) -> bool:
    """Whether a local run directory holds a ``postrl sft`` or ``postrl dpo`` run (no reward section)."""
    import yaml

    path = Path(run) / "config.yaml"
    if "://" in run or not path.is_file():
        return False
    saved = yaml.safe_load(path.read_text()) or {}
    return "reward" not in saved and "epochs" in saved


def _local_run(config: RunConfig) -> Path:
    """The run's folder on this machine; a URL run's final model (or latest checkpoint) is fetched first."""
    if config.run_url is None:
        return config.run_dir
    from postrl.run.store import RunStore

    store = RunStore(config.run_url, config.run_dir)
    if store.fetch_folder("final_model") is None:
        store.fetch_latest_checkpoint()
    return config.run_dir


def _resolve_run(
    model: str | None, run: str | None, task: str | None, config: str | None
) -> tuple[str, RunConfig | None]:
    """The model to evaluate and the config whose data and reward apply (from --run or --config)."""
    run_config: RunConfig | None = None
    if run is not None:
        from postrl.run.place import resume_config

        if _is_offline_run(run):  # an sft or dpo run: its model, with a task, or --data and --config
            model = model or run_model_path(Path(run))
            if config is None and not task:
                raise ConfigError(
                    f"{run} is a supervised or preference run with no reward to score with: pass "
                    "--task NAME, or --data FILE with --config CONFIG.yaml (whose reward scores it)"
                )
            if config is not None:
                run_config = load_config(config)
        else:
            run_config = resume_config(run, [])  # a folder or a URL, as train --resume reads it
            if model is None:
                model = run_model_path(_local_run(run_config))
    elif config is not None:
        run_config = load_config(config)
        model = model or run_config.model.path  # the config's model, as training would start from it
    if model is None:
        raise ConfigError("postrl eval needs --model PATH, --run runs/NAME or --config CONFIG.yaml")
    return model, run_config


def _held_out_files(run: str | None, run_config: RunConfig | None) -> list[str] | None:
    """A run's own held-out prompts (data.val_files); None when its task has a built-in test split."""
    if run is None or run_config is None:
        return None
    if run_config.data.val_files:
        return list(run_config.data.val_files)
    if run_config.data.task is None:
        raise ConfigError(
            f"{run} trained on {', '.join(run_config.data.train_files)}, which has no built-in "
            "held-out split: pass --data FILE (held-out prompts, scored with the run's reward) or "
            "--task NAME"
        )
    return None


@dataclass(frozen=True)
class SampledEval:
    """``postrl eval``'s harness options: n samples per prompt, the k of pass@k and maj@k, the
    sampling, an OpenAI-compatible server instead of a local model, JSON output."""

    n: int = 1
    ks: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    url: str | None = None
    as_json: bool = False

    def checked(self, model: str | None) -> SampledEval:
        if self.n < 1:
            raise ConfigError(f"--n {self.n}: give at least 1 response per prompt")
        if self.ks and self.n == 1:
            raise ConfigError(
                f"--k {' '.join(map(str, self.ks))} needs sampled responses: give --n (at least the largest k)"
            )
        if self.url is not None and model is None:
            raise ConfigError("--url needs --model FOLDER: the tokenizer that builds the prompts")
        if self.url is not None:
            why = can_connect(*url_endpoint(self.url), timeout_s=5.0)
            if why is not None:
                raise ConfigError(
                    f"no rollout server answers at {self.url} ({why}); start it first (postrl serve-rollout), "
                    "or fix --url"
                )
        return self

    def run(
        self, model: str, run_config: RunConfig | None, task: str | None, data: list[str] | None, max_tokens: int | None
    ) -> None:
        from postrl.run.eval_report import run_harness

        run_harness(
            model=model,
            url=self.url,
            run_config=run_config,
            task=task,
            data=data,
            n=self.n,
            ks=self.ks,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=max_tokens,
            as_json=self.as_json,
        )

    def wanted(self, run_config: RunConfig | None) -> bool:
        """Whether the harness runs: sampling, JSON, a URL, a config with several or generated sets,
        or an ``agent:`` run (whose answers are episodes)."""
        named = run_config is not None and (
            bool(run_config.data.eval_sets) or run_config.data.generates_prompts or run_config.agent is not None
        )
        return self.n > 1 or self.as_json or self.url is not None or named


def run_eval(
    model: str | None,
    run: str | None,
    task: str | None,
    data: list[str] | None,
    config: str | None,
    max_tokens: int | None,
    out: str | None,
    sampling: SampledEval | None = None,
) -> int:
    """``postrl eval``: one line with the held-out accuracy (and mean reward with --data), or with
    sampling, several sets or --json, the harness's table of greedy, mean@n, pass@k and maj@k."""
    from postrl.models.loading import load_causal_lm, load_tokenizer

    sampling = (sampling or SampledEval()).checked(model)
    model, run_config = _resolve_run(model, run, task, config)
    if task and data:
        raise ConfigError("give either --task or --data, not both")
    if run_config is None and not task and not data:
        task = DEFAULT_TASK  # a bare model folder: one rule for the one-line and the sampled evaluation
    if sampling.wanted(run_config):
        if out:
            raise ConfigError(
                "--out writes the samples of a one-line evaluation (no --n, --json, --url, eval sets or agent run)"
            )
        sampling.run(model, run_config, task, data, max_tokens)
        return 0
    tokenizer = load_tokenizer(model)
    policy = load_causal_lm(model)
    if not data and not task:
        data = _held_out_files(run, run_config)
    if not data:
        task = task or (run_config.data.task if run_config and run_config.data.task else DEFAULT_TASK)
        on_task = evaluate_model(policy, tokenizer, task, max_tokens or 16, run_config.rollout if run_config else None)
        print(f"{task}: held-out accuracy {on_task.accuracy:.3f} ({on_task.correct}/{on_task.total}) [{model}]")
        return 0
    if run_config is None:
        raise ConfigError("postrl eval --data needs the reward to score with: --run runs/NAME or --config CONFIG.yaml")
    _eval_files(policy, tokenizer, model, data, run_config, max_tokens, out)
    return 0


def _eval_files(
    policy: Any,
    tokenizer: Any,
    model: str,
    data: list[str],
    run_config: RunConfig,
    max_tokens: int | None,
    out: str | None,
) -> None:
    """``postrl eval --data``: the files' prompts answered greedily and scored by the run's reward
    components; one line with the accuracy, the mean reward and the unscorable count."""
    options = prompt_source(run_config.data, tokenizer, run_config.agent).options()
    dataset = load_prompt_dataset(data, tokenizer, **options)
    name = ", ".join(Path(f).name for f in data)
    result = evaluate_with_rewards(
        policy,
        tokenizer,
        dataset,
        run_config.reward,
        run_config.rollout,
        max_tokens or run_config.rollout.max_tokens,
        name,
        Path(out) if out else None,
    )
    mean = "n/a" if result.mean_reward is None else f"{result.mean_reward:.3f}"
    acc = (
        "accuracy n/a (no reward component is an accuracy: mark one accuracy: true)"
        if result.accuracy is None
        else f"accuracy {result.accuracy:.3f} ({result.correct}/{result.total})"
    )
    print(
        f"{name}: {acc}, mean reward {mean}, "
        f"unscorable {result.unscorable} [{model}]" + (f"; samples in {out}" if out else "")
    )
