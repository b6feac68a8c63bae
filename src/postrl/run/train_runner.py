"""``postrl train``: check a config, build the run's parts, run the steps, clean up.

:func:`train` checks everything it can before writing anything (the run directory, the model's
context, devices, the memory plan, remote servers), builds the parts (:func:`build_components`),
then hands the Controller to the step loop every command shares (:mod:`postrl.run.lifecycle`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from postrl.config.command import RunCommandConfig
from postrl.config.data import NO_HELD_OUT
from postrl.config.distill import is_url
from postrl.config.loading import save_config
from postrl.config.run import ConfigError, RunConfig
from postrl.controller.components import Components
from postrl.controller.controller import Controller
from postrl.data.prompt_source import prompt_source
from postrl.models.devices import DeviceError, resolve_device
from postrl.models.host_memory import keep_freed_memory
from postrl.models.loading import load_tokenizer
from postrl.models.numerics import Numerics, resolve_numerics
from postrl.reward.columns import check_columns
from postrl.reward.factory import make_reward_service
from postrl.rollout.factory import EngineSpec
from postrl.run.batch_sources import make_batch_source
from postrl.run.checkpoint import save_checkpoint
from postrl.run.foreign_logs import AGENT_OUTPUT_LOG, ForeignLogs
from postrl.run.lifecycle import RunSite, StepLoop, report_skipped, resume_point, stderr_echo
from postrl.run.metrics import ConsoleSink, JsonlSink, MetricSink, TensorBoardSink
from postrl.run.model_card import trained_how, write_model_card
from postrl.run.place import PUBLISHED_AT_END, RunPlace, check_steps_left
from postrl.run.plan.check import check_plan
from postrl.run.plots import plot_metrics
from postrl.run.resolve import resolved_run
from postrl.run.trackers import make_tracker
from postrl.run.validation import Validator, load_eval_sets, load_validation_set
from postrl.run.watch import EXACT_MODE, describe_placement, run_watches
from postrl.scheduling.factory import make_scheduler
from postrl.train.critic import CriticSpec
from postrl.train.factory import PolicySpec
from postrl.train.teachers.teachers import Teachers, make_teachers
from postrl.types import StepMetrics
from postrl.workers.net import can_connect, host_port, url_endpoint

log = logging.getLogger(__name__)


def build_components(config: RunConfig, numerics: Numerics | None = None) -> Components:
    """The parts of a run, placed by the configured scheduler; the step code does not know where.
    Settings decided from the model (an unset ``data.max_prompt_tokens``) are decided here first;
    ``numerics``: the run's (default: resolved for this machine)."""
    config = resolved_run(config)
    numerics = numerics or run_numerics(config)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.model.path)
    prompts = prompt_source(config.data, tokenizer)
    if config.scores_with_components:
        check_columns(config.reward, ((p.source, p.columns) for p in prompts.train().prompts))
    scheduler = make_scheduler(config.scheduler, config.import_paths, critic=config.algorithm.critic is not None)
    built: list = []
    try:
        built.append(scheduler.train_group(PolicySpec.of_run(config, numerics)))
        built.append(scheduler.rollout_pool(EngineSpec.of_run(config), tokenizer))
        built.append(scheduler.reward_service(make_reward_service, config.reward))
        built.append(scheduler.experience_buffer(config.buffer, config.seed))
        if config.algorithm.critic is not None:
            built.append(scheduler.critic_worker(CriticSpec.of_run(config, tokenizer.pad_token_id)))
        errors_log = config.run_dir / "episode_errors.log"
        source = make_batch_source(config.agent, tokenizer, built[1], built[2], errors_log, config.model.path)
        teachers = None if config.algorithm.distill is None else run_teachers(config, tokenizer)
    except BaseException:
        for part in built:
            part.close()
        scheduler.close()
        raise
    trainer, rollout, reward, buffer, *critic = built
    return Components(
        config,
        tokenizer,
        prompts,
        rollout,
        reward,
        trainer,
        buffer,
        source,
        scheduler,
        critic[0] if critic else None,
        teachers,
        numerics,
    )


def run_teachers(config: RunConfig, tokenizer: Any) -> Teachers:
    """``algorithm.distill``'s teachers: a folder's in this process on the trainer's device, at the
    rollout's temperature; each checked against the student's tokenizer."""
    assert config.algorithm.distill is not None
    device = resolve_device(config.train.device, "train.device")
    return make_teachers(
        config.algorithm.distill,
        tokenizer,
        config.model.path,
        device,
        config.rollout.temperature,
        config.train.micro_batch_size,
    )


def close_components(parts: Components) -> None:
    """Stop every worker, then the scheduler (a Ray instance started for the run ends here)."""
    try:
        for part in (parts.reward, parts.rollout, parts.trainer, parts.critic, parts.buffer, parts.teachers):
            if part is not None:
                part.close()
    finally:
        if parts.scheduler is not None:
            parts.scheduler.close()


def make_sinks(
    config: RunCommandConfig,
    run_dir: Path,
    resume_step: int | None,
    echo: Callable[[str], None],
    total: int | None = None,
    policies: tuple[str, ...] = (),
    exact: bool = False,
) -> list[MetricSink]:
    """The console, then each of ``logging.trackers``, then the Prometheus endpoint when configured;
    ``policies``: a run with several (the console shows each one's metrics); ``exact``: the run's
    rollout.exact (the console shows the engine-trainer difference)."""
    lg = config.logging
    sinks: list[MetricSink] = []
    if lg.console:
        sinks.append(ConsoleSink(echo, total, policies=policies, exact=exact))
    for name in lg.trackers:
        if name == "jsonl":
            sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
        else:
            sinks.append(make_tracker(name, config, run_dir, stderr_echo))
    if lg.prometheus is not None:
        from postrl.run.prometheus import PrometheusExporter

        sinks.append(PrometheusExporter(lg.prometheus, lg.stall_after_s, config.name, stderr_echo))
    return sinks


def describe_accuracy(config: RunConfig, component: str | None) -> str:
    """Which number the run's ``accuracy`` is, said once at the start."""
    if not config.scores_with_components:
        return f"accuracy: the environment's reward >= {config.reward.accuracy_threshold:g}"
    if component is None:
        return "accuracy: none (no exact_match or math component; mark one component accuracy: true to report one)"
    return f"accuracy: reward component '{component}' >= {config.reward.accuracy_threshold:g}"


NOTHING_TO_PLOT = "plot: nothing to plot (no step had a scorable sample; see samples/ and reward_workers.log)"


def make_validator(parts: Components, echo: Callable[[str], None] = print) -> Validator | None:
    """Validation every logging.eval_every steps: the prompt source's held-out set and data.eval_sets."""
    config = parts.config
    if not config.logging.eval_every:
        return None
    dataset = load_validation_set(config, parts.prompts, echo)
    named = load_eval_sets(config, parts.tokenizer, echo)
    if (dataset is None or not len(dataset)) and not named:
        raise ConfigError(f"logging.eval_every={config.logging.eval_every} needs held-out prompts: {NO_HELD_OUT}")
    return Validator(config, dataset, named)


def check_servers(config: RunConfig, timeout_s: float = 5.0) -> None:
    """The external servers a run depends on answer before anything is written."""
    urls = []
    if config.rollout.backend == "openai" and config.rollout.url:
        urls.append(("rollout.url", config.rollout.url))
    if config.reward.remote is not None:
        urls.append(("reward.remote.url", config.reward.remote.url))
    if config.algorithm.distill is not None:
        for i, teacher in enumerate(config.algorithm.distill.teachers):
            if is_url(teacher.source):
                urls.append((f"algorithm.distill.teachers[{i}].source", teacher.source))
    address = config.scheduler.address if config.scheduler.type == "ray" else None
    endpoint = host_port(address) if address else None
    if endpoint is not None:  # the scheduler bounds the whole connection; a closed port is known now
        why = can_connect(*endpoint, timeout_s=timeout_s)
        if why is not None:
            raise ConfigError(f"cannot reach the Ray cluster at {address} (scheduler.address={address}): {why}")
    for field, url in urls:
        why = can_connect(*url_endpoint(url), timeout_s=timeout_s)
        if why is not None:
            raise ConfigError(f"{field}={url} cannot be reached ({why}); start the server first, or fix the URL")


def run_numerics(config: RunConfig) -> Numerics:
    """The run's numerics on this machine; exact mode whose dtypes resolve apart here is refused."""
    try:
        return resolve_numerics(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_devices(config: RunConfig) -> None:
    """A CUDA device that is not there is refused before any work (never a silent fall back to the CPU)."""
    try:
        resolve_device(config.train.device, "train.device")
        resolve_device(config.rollout.device, "rollout.device")
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None


def train(
    config: RunConfig,
    resume: bool = False,
    on_step: Callable[[StepMetrics], None] | None = None,
    overwrite: bool = False,
) -> Controller:
    """Validate, build, then run; nothing is written into the run directory before the config,
    the model and the data have been checked. A signal stops the run after the current step
    (:class:`RunInterrupted`), with a checkpoint of the last completed step."""
    keep_freed_memory()
    run_dir, site = config.run_dir, RunSite(config, "train")
    place = site.place
    done = site.check(resume, overwrite)  # a second live controller on this run is refused before any work
    if resume:
        check_steps_left(config.steps, done, f"steps={config.steps}")
    config = resolved_run(config)  # what the run uses and config.yaml records; the caller's config is unchanged
    check_devices(config)
    numerics = run_numerics(config)
    echo = stderr_echo
    check_plan(config, echo)
    check_servers(config)
    parts = build_components(config, numerics)
    try:
        validator = make_validator(parts, echo)
        site.open(resume, overwrite, echo)
        save_config(config, run_dir / "config.yaml")
        place.publish("config.yaml")
        report_skipped(parts.prompts.train().skipped, run_dir, echo)
        parts.reward.set_log_file(run_dir / "reward_workers.log")
        echo(describe_placement(config))
        echo(f"numerics: {numerics.describe()}")
        if config.rollout.exact:
            echo(EXACT_MODE)
        echo(describe_accuracy(config, parts.reward.accuracy_component))
        if place.url:
            echo(f"run: {place.url} (working copy on this machine: {run_dir})")
        controller = Controller(parts)
        resume_step = None
        if resume:
            resume_step = _resume(controller, place, echo)
        else:
            controller.start()
        try:
            with agent_output(config):
                _run_loop(controller, config, resume_step, on_step, place, validator)
        finally:
            controller.close()
    finally:
        try:
            close_components(parts)
        finally:
            site.close()
    if place.url and not config.keep_local_copy:
        place.drop_local_copy(echo)
    return controller


def agent_output(config: RunConfig) -> contextlib.AbstractContextManager:
    """For a run whose agent function (or seated environment) runs in this process, its libraries' log records to the run
    directory (:mod:`postrl.run.foreign_logs`); otherwise nothing."""
    if config.agent is not None and (config.agent.function is not None or config.agent.seats is not None):
        return ForeignLogs(config.run_dir / AGENT_OUTPUT_LOG)
    return contextlib.nullcontext()


class TrainJob:
    """``postrl train`` as the step loop sees it: the Controller's steps, and its checkpoints."""

    command = "train"

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    @property
    def completed_steps(self) -> int:
        return self.controller.step_count

    def step(self) -> StepMetrics:
        return self.controller.step()

    def restore_abandoned_step(self) -> bool:
        return self.controller.restore_abandoned_step()

    def checkpoint(self) -> Path:
        c, parts = self.controller, self.controller.parts
        keep = c.config.checkpoint.keep_last
        return save_checkpoint(
            c.config.run_dir, c.step_count, parts.trainer, c.state_dict(), keep, parts.tokenizer, parts.critic
        )

    def save_final(self, folder: Path) -> None:
        c = self.controller
        c.parts.trainer.save_pretrained(folder)
        c.parts.tokenizer.save_pretrained(folder)
        how = trained_how(c.config, c.step_count)
        chat = bool(c.parts.tokenizer.chat_template)
        write_model_card(folder, c.config.name, c.config.model.path, c.config.data, how, chat)


def _run_loop(
    controller: Controller,
    config: RunConfig,
    resume_step: int | None,
    on_step: Callable[[StepMetrics], None] | None,
    place: RunPlace,
    validator: Validator | None = None,
) -> None:
    observers: list[Callable[[StepMetrics], None]] = []
    if validator is not None:
        observers.append(lambda m: validator.observe(m, controller.source, controller.batches.generation_version))
    observers += [watch.observe for watch in run_watches(config, stderr_echo, controller.parts.numerics)]
    if on_step is not None:
        observers.append(on_step)
    loop = StepLoop(
        config,
        place,
        config.steps,
        sinks=lambda echo: make_sinks(
            config, config.run_dir, resume_step, echo, config.steps, exact=config.rollout.exact
        ),
        observers=observers,
        published_at_end=PUBLISHED_AT_END,
        at_end=lambda: f"plot: {plot}" if (plot := plot_metrics(config.run_dir)) else NOTHING_TO_PLOT,
    )
    loop.run(TrainJob(controller))


def _resume(controller: Controller, place: RunPlace, echo: Callable[[str], None]) -> int:
    checkpoint, state = resume_point(place, echo)
    controller.parts.trainer.load_checkpoint(checkpoint)
    if controller.parts.critic is not None:
        controller.parts.critic.load_checkpoint(checkpoint / "critic")
    controller.start(state)
    return controller.step_count
