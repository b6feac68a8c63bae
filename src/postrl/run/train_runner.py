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

import torch

from postrl.config.agent import FunctionAgent, SeatedAgent, VerifiersAgent
from postrl.config.command import RunCommandConfig
from postrl.config.data import NO_HELD_OUT
from postrl.config.distill import is_url
from postrl.config.loading import save_config
from postrl.config.run import ConfigError, RunConfig
from postrl.controller.components import Components
from postrl.data.prompt_source import prompt_source
from postrl.models.devices import DeviceError, resolve_device
from postrl.models.host_memory import keep_freed_memory
from postrl.models.loading import load_tokenizer
from postrl.models.numerics import Numerics, resolve_numerics
from postrl.reward.columns import check_columns
from postrl.reward.factory import make_reward_service
from postrl.rollout.agentic.verifiers_env import load_environment
from postrl.run.batch_sources import make_batch_source
from postrl.run.foreign_logs import AGENT_OUTPUT_LOG, ForeignLogs
from postrl.run.lifecycle import RunSite, StepLoop, report_skipped, stderr_echo
from postrl.run.metrics import ConsoleSink, JsonlSink, MetricSink, TensorBoardSink
from postrl.run.place import PUBLISHED_AT_END, RunPlace, check_steps_left
from postrl.run.plan.check import check_plan, check_policies_plan
from postrl.run.plots import plot_metrics
from postrl.run.policy_workers import place_policy
from postrl.run.resolve import resolved_run
from postrl.run.trackers import make_tracker
from postrl.run.train_job import RunJob, TrainJob, close_components
from postrl.run.validation import Validator, load_eval_sets, load_validation_set
from postrl.scheduling.factory import make_scheduler
from postrl.scheduling.ray_scheduler import teacher_cpus
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
    prompts = prompt_source(config.data, tokenizer, config.agent)
    # a verifiers environment is loaded here, once: one that fails stops the run before the model loads
    if isinstance(config.agent, VerifiersAgent):
        load_environment(config.agent)
    if config.scores_with_components:
        check_columns(config.reward, ((p.source, p.columns) for p in prompts.train().prompts))
    scheduler = make_scheduler(
        config.scheduler,
        config.import_paths,
        critic=config.algorithm.critic is not None,
        more_cpus=teacher_cpus(config),
    )
    built: list = []
    try:
        reward = scheduler.reward_service(make_reward_service, config.reward)
        built.append(reward)
        placed = place_policy(scheduler, config, tokenizer, numerics, built)
        errors_log = config.run_dir / "episode_errors.log"
        source = make_batch_source(config.agent, tokenizer, placed.rollout, reward, errors_log, config.model.path)
    except BaseException:
        for part in built:
            part.close()
        scheduler.close()
        raise
    return Components(
        config,
        tokenizer,
        prompts,
        placed.rollout,
        reward,
        placed.trainer,
        placed.buffer,
        source,
        scheduler,
        placed.critic,
        placed.teachers,
        numerics,
    )


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
) -> RunJob:
    """Validate, build, then run, for one policy or several (``policies:``); nothing is written into
    the run directory before the config, the models and the data have been checked. A signal stops
    the run after the current step (:class:`RunInterrupted`), with a checkpoint of the last
    completed step. Returns the job: its Controllers and completed steps."""
    keep_freed_memory()
    site = RunSite(config, "train")
    place, echo = site.place, stderr_echo
    done = site.check(resume, overwrite)  # a second live controller on this run is refused before any work
    if resume:
        check_steps_left(config.steps, done, f"steps={config.steps}")
    if config.policies is None:
        config = resolved_run(config)  # what the run uses and config.yaml records; the caller's is unchanged
    runs = config.policy_runs() or {"": config}
    for run in runs.values():
        check_devices(run)
    numerics = {name: run_numerics(run) for name, run in runs.items()}
    if config.policies is None:
        check_plan(config, echo)
    else:
        check_policies_plan(config, echo)
    for run in runs.values():
        check_servers(run)
    job = make_job(config, numerics, echo)
    try:
        site.open(resume, overwrite, echo)
        save_config(config, config.run_dir / "config.yaml")
        place.publish("config.yaml")
        report_skipped(job.first.prompts.train().skipped, config.run_dir, echo)
        job.first.reward.set_log_file(config.run_dir / "reward_workers.log")
        for line in job.startup_lines():
            echo(line)
        if place.url:
            echo(f"run: {place.url} (working copy on this machine: {config.run_dir})")
        resume_step = job.start(place, resume, echo)
        _run_loop(job, config, resume_step, job.observers(stderr_echo) + ([on_step] if on_step else []), place)
    finally:
        try:
            job.close()
        finally:
            site.close()
    if place.url and not config.keep_local_copy:
        place.drop_local_copy(echo)
    return job


def make_job(config: RunConfig, numerics: dict[str, Numerics], echo: Callable[[str], None]) -> RunJob:
    """The run's parts, built and placed, and its validation, as the job that steps them."""
    from postrl.run.policies_runner import PoliciesJob, build_policies

    if config.policies is not None:
        policies = build_policies(config, numerics)
        try:
            return PoliciesJob(policies, make_validator(next(iter(policies.parts.values())), echo))
        except BaseException:
            policies.close()
            raise
    parts = build_components(config, numerics[""])
    try:
        return TrainJob(parts, make_validator(parts, echo))
    except BaseException:
        close_components(parts)
        raise


def _run_loop(job: RunJob, config: RunConfig, resume_step: int | None, observers: list, place: RunPlace) -> None:
    loop = StepLoop(
        config,
        place,
        config.steps,
        sinks=lambda echo: make_sinks(
            config, config.run_dir, resume_step, echo, config.steps, job.names, config.rollout.exact
        ),
        observers=observers,
        published_at_end=PUBLISHED_AT_END,
        at_end=lambda: f"plot: {plot}" if (plot := plot_metrics(config.run_dir)) else NOTHING_TO_PLOT,
    )
    with agent_output(config):
        loop.run(job)


def agent_output(config: RunConfig) -> contextlib.AbstractContextManager:
    """For a run whose agent function (or seated environment, or verifiers environment) runs in this process, its
    libraries' log records to the run directory (:mod:`postrl.run.foreign_logs`); otherwise nothing."""
    if isinstance(config.agent, FunctionAgent | SeatedAgent | VerifiersAgent):
        return ForeignLogs(config.run_dir / AGENT_OUTPUT_LOG)
    return contextlib.nullcontext()
