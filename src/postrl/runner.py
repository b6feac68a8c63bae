"""``postrl train``: set up from a config, run the steps, checkpoint, clean up.

The entry point reads like a table of contents: :func:`train` = setup -> loop -> cleanup.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from postrl.buffer import OnPolicyBuffer
from postrl.checkpoint import latest_checkpoint, load_run_state, save_checkpoint
from postrl.config import RewardConfig, RunConfig, load_config, save_config
from postrl.controller import Components, Controller
from postrl.data.dataset import PromptDataset, build_prompts, load_prompt_dataset
from postrl.metrics import ConsoleSink, JsonlSink, MetricSink, TensorBoardSink
from postrl.models import load_causal_lm, load_tokenizer
from postrl.reward import RewardService
from postrl.reward.client import RemoteRewardService
from postrl.rollout.factory import make_rollout_worker
from postrl.tasks import task_rows
from postrl.train.worker import TrainWorker
from postrl.types import StepMetrics

log = logging.getLogger(__name__)


def load_dataset(config: RunConfig, tokenizer) -> PromptDataset:
    d = config.data
    options = dict(
        prompt_column=d.prompt_column,
        messages_column=d.messages_column,
        apply_chat_template=d.apply_chat_template,
        max_prompt_tokens=d.max_prompt_tokens,
        on_bad_row=d.on_bad_row,
    )
    if d.task is not None:
        return build_prompts(iter(task_rows(d.task, "train")), tokenizer, **options)
    return load_prompt_dataset(d.train_files, tokenizer, **options)


def build_components(config: RunConfig) -> Components:
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.model.path)
    dataset = load_dataset(config, tokenizer)
    policy = load_causal_lm(config.model.path, config.model.dtype)
    ref_model = load_causal_lm(config.model.path, config.model.dtype) if config.algorithm.kl_beta > 0 else None
    rollout = make_rollout_worker(config.rollout, config.model.path, tokenizer, config.model.dtype, config.seed)
    trainer = TrainWorker(
        policy,
        config.train,
        config.algorithm,
        temperature=config.rollout.temperature,
        ref_model=ref_model,
        seed=config.seed,
        gradient_checkpointing=config.model.gradient_checkpointing,
    )
    return Components(config, tokenizer, dataset, rollout, make_reward_service(config.reward), trainer, OnPolicyBuffer())


def make_reward_service(config: RewardConfig) -> RewardService | RemoteRewardService:
    """The remote service when ``reward.remote`` is set, else scoring in this process's worker pool."""
    if config.remote is not None:
        return RemoteRewardService(config.remote)
    return RewardService(config)


def make_sinks(config: RunConfig, run_dir: Path, resume_step: int | None, echo: Callable[[str], None]) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    if config.logging.console:
        sinks.append(ConsoleSink(echo))
    if config.logging.jsonl:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step))
    if config.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
    return sinks


def train(
    config: RunConfig, resume: bool = False, on_step: Callable[[StepMetrics], None] | None = None
) -> Controller:
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    with tempfile.TemporaryDirectory(prefix="postrl-sync-") as sync_dir:
        parts = build_components(config)
        controller = Controller(parts, sync_dir=Path(sync_dir))
        resume_step = _resume(controller, run_dir) if resume else None
        bar = tqdm(total=config.steps, initial=controller.step_count, disable=not config.logging.progress_bar,
                   desc=config.name, unit="step", leave=False)
        sinks = make_sinks(config, run_dir, resume_step, echo=bar.write)
        try:
            while controller.step_count < config.steps:
                metrics = controller.step()
                for sink in sinks:
                    sink.write(metrics)
                if on_step:
                    on_step(metrics)
                bar.update(1)
                every = config.checkpoint.every_steps
                if controller.step_count == config.steps or (every and controller.step_count % every == 0):
                    save_checkpoint(run_dir, controller.step_count, parts.trainer, controller.state_dict(), config.checkpoint.keep_last)
        finally:
            bar.close()
            for sink in sinks:
                sink.close()
            parts.reward.close()
            close_rollout = getattr(parts.rollout, "close", None)
            if close_rollout is not None:
                close_rollout()
    return controller


def _resume(controller: Controller, run_dir: Path) -> int:
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'} to resume from")
    controller.parts.trainer.load_checkpoint(checkpoint)
    controller.load_state_dict(load_run_state(checkpoint))
    log.info("resumed from %s at step %d", checkpoint, controller.step_count)
    return controller.step_count


def resume_config(run_dir: str | Path, overrides: list[str]) -> RunConfig:
    """The run's saved config, with overrides (e.g. ``steps=200``) applied on top."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(path, overrides)
    expected = Path(run_dir).resolve()
    if config.run_dir.resolve() != expected:
        config = copy.deepcopy(config)
        config.output_dir, config.name = str(expected.parent), expected.name
    return config
