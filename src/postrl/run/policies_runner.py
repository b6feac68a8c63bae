"""``postrl train`` with ``policies:``: several trainable policies acting in the episodes of one
agent function or seated game.

Each policy is a one-policy run of its own (its config from :meth:`RunConfig.policy_runs`): its
trainer, rollout engines, buffer, weight version and Controller; what they share is the prompts,
the reward service and the episodes (:class:`~postrl.controller.policy_episodes.SharedEpisodes`),
run once per step with every policy's engine serving its own calls. A step is each policy's step
in turn, in the order the config names them; every policy trains on its own samples only, and its
metrics carry its name (``solver/reward/mean``). One checkpoint holds every policy
(``checkpoints/step_N/policies/NAME``, each a loadable model folder under ``model/``), written and
completed at once, so a resumed run restarts every policy from the same step. Validation
(``logging.eval_every``) runs the held-out episodes once after every policy's step, each policy
scoring its own part (``NAME/val/...``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from postrl.config.agent import AgentBase, FunctionAgent, SeatedAgent
from postrl.config.run import ConfigError, RunConfig
from postrl.controller.batches import run_sampling
from postrl.controller.components import Components
from postrl.controller.controller import Controller
from postrl.controller.env_episodes import episode_limits
from postrl.controller.policy_episodes import EpisodesOfPolicies, HeldOutEpisodes, PolicyEpisodes, SharedEpisodes
from postrl.data.prompt_source import prompt_source
from postrl.models.loading import load_tokenizer
from postrl.models.numerics import Numerics
from postrl.reward.factory import make_reward_service
from postrl.rollout.agentic.agent_function import PolicyRollouts, RecordedAgents, load_agent_function
from postrl.rollout.agentic.env_lookup import seated_environment_factory
from postrl.rollout.agentic.episode_ops import EpisodeSchedule
from postrl.rollout.agentic.individual import Individual
from postrl.rollout.agentic.lockstep import Lockstep
from postrl.rollout.agentic.seated_games import SeatedGames, SeatPlayer
from postrl.rollout.agentic.seats import check_seated_game
from postrl.run.checkpoint import save_policies_checkpoint
from postrl.run.lifecycle import resume_point
from postrl.run.model_card import trained_how, write_model_card
from postrl.run.place import RunPlace
from postrl.run.policy_workers import PolicyWorkers, place_policy
from postrl.run.resolve import resolved_run
from postrl.run.train_job import Observer, describe_accuracy, policy_lines
from postrl.run.validation import Validator
from postrl.run.watch import Watch, run_watches
from postrl.scheduling.base import Scheduler
from postrl.scheduling.factory import make_scheduler
from postrl.scheduling.ray_scheduler import cpus_asked, teacher_cpus
from postrl.serve.recording_server import RecordingServer, ServedPolicy
from postrl.types import StepMetrics
from postrl.types.metric_names import PERF_GEN_TOKENS_PER_S, TIME_GENERATE_S, TIME_VALIDATE_S
from postrl.workers.roles import RewardService


class Policies:
    """Every policy's parts and Controller, and what they share; :meth:`close` stops them all."""

    def __init__(
        self, config: RunConfig, schedulers: list[Scheduler], reward: RewardService, parts: dict[str, Components]
    ) -> None:
        """``schedulers``: one per policy, the first's also placing what the policies share."""
        self.config = config
        self.schedulers = schedulers
        self.reward = reward
        self.parts = parts
        self.controllers = {name: Controller(p) for name, p in parts.items()}

    def close(self) -> None:
        try:
            for controller in self.controllers.values():
                controller.close()  # the first closes the shared episodes and their server
        finally:
            try:
                for p in self.parts.values():
                    for part in (p.rollout, p.trainer, p.critic, p.buffer, p.teachers):
                        if part is not None:
                            part.close()
                self.reward.close()
            finally:
                close_schedulers(self.schedulers)


def close_schedulers(schedulers: list[Scheduler]) -> None:
    """Last started, first closed: the first ends a Ray instance it started, after the others."""
    try:
        for scheduler in reversed(schedulers[1:]):
            scheduler.close()
    finally:
        if schedulers:
            schedulers[0].close()


def make_schedulers(config: RunConfig, runs: dict[str, RunConfig]) -> list[Scheduler]:
    """A scheduler per policy, each placing that policy's workers (under Ray: its own placement
    groups); a Ray instance started for the run holds the CPUs of them all."""
    critic = {name: run.algorithm.critic is not None for name, run in runs.items()}
    asks = {
        name: cpus_asked(run.scheduler, ("rollout", "train"), critic[name]) + teacher_cpus(run)
        for name, run in runs.items()
    }
    schedulers: list[Scheduler] = []
    try:
        for i, (name, run) in enumerate(runs.items()):
            more = sum(a for other, a in asks.items() if other != name) if i == 0 else 0.0
            schedulers.append(make_scheduler(run.scheduler, config.import_paths, critic=critic[name], more_cpus=more))
    except BaseException:
        close_schedulers(schedulers)
        raise
    return schedulers


def check_episodes(agent: AgentBase) -> None:
    """Before anything is placed: the agent function imports, or one game of the seated environment
    is made and its seats are those of ``agent.seats`` (a ConfigError names what is wrong)."""
    if not isinstance(agent, SeatedAgent):
        return
    try:
        check_seated_game(seated_environment_factory(agent.env), agent.env_options, agent.seats, agent.env)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def policies_episodes(
    config: RunConfig, runs: dict[str, RunConfig], workers: dict[str, PolicyWorkers], tokenizers: dict[str, Any]
) -> EpisodesOfPolicies:
    """What plays the batches' episodes: the seated game at token level on each seat's policy's
    engine (at its own sampling), or the agent function against a recording server whose calls
    name their policy."""
    agent = config.agent
    if isinstance(agent, SeatedAgent):
        players = {
            name: SeatPlayer(w.rollout, tokenizers[name], run_sampling(runs[name].rollout))
            for name, w in workers.items()
        }
        schedule: EpisodeSchedule = Lockstep()
        if agent.scheduling == "individual":
            joins = all(w.rollout.joins_calls for w in workers.values())
            schedule = Individual(joins, agent.max_concurrent_episodes)
        make_env = seated_environment_factory(agent.env)
        limits = episode_limits(agent)
        return SeatedGames(
            make_env, agent.env_options, agent.env, agent.seats, players, limits, schedule, agent.on_prefix_break
        )
    assert isinstance(agent, FunctionAgent)  # policies: act in an agent function's or a seated game's episodes
    served = {name: ServedPolicy(w.rollout, tokenizers[name]) for name, w in workers.items()}
    server = RecordingServer(served, agent.tools_in_prompt)
    try:
        function = load_agent_function(agent.function)
        return RecordedAgents(server, function, agent.env_workers, agent.function_timeout_s)
    except BaseException:
        server.close()
        raise


def build_policies(config: RunConfig, numerics: dict[str, Numerics]) -> Policies:
    """The parts of every policy, placed by the run's scheduler, and the episodes they share
    (``numerics``: each policy's, by name)."""
    agent = config.agent
    assert agent is not None  # policies: act in an agent function's or a seated game's episodes
    runs = {name: resolved_run(run) for name, run in config.policy_runs().items()}
    torch.manual_seed(config.seed)
    tokenizers = {name: load_tokenizer(run.model.path) for name, run in runs.items()}
    prompts = prompt_source(config.data, next(iter(tokenizers.values())), config.agent)
    check_episodes(agent)
    schedulers = make_schedulers(config, runs)
    built: list[Any] = []
    try:
        reward = schedulers[0].reward_service(make_reward_service, config.reward)
        built.append(reward)
        workers = {
            name: place_policy(scheduler, run, tokenizers[name], numerics[name], built)
            for scheduler, (name, run) in zip(schedulers, runs.items(), strict=True)
        }
        shared = SharedEpisodes(policies_episodes(config, runs, workers, tokenizers))
        built.append(shared)
        parts = {}
        for name, run in runs.items():
            w, tokenizer = workers[name], tokenizers[name]
            assert isinstance(agent, FunctionAgent | SeatedAgent)
            source = PolicyEpisodes(name, shared, agent, tokenizer, reward, run.run_dir / "episode_errors.log")
            parts[name] = Components(
                run,
                tokenizer,
                prompts,
                w.rollout,
                reward,
                w.trainer,
                w.buffer,
                source,
                None,
                w.critic,
                w.teachers,
                numerics[name],
            )
        return Policies(config, schedulers, reward, parts)
    except BaseException:
        for part in built:
            part.close()
        close_schedulers(schedulers)
        raise


def named_echo(name: str, echo: Callable[[str], None]) -> Callable[[str], None]:
    return lambda text: echo(f"{name}: {text}")


def observe_policy(watch: Watch, name: str, metrics: StepMetrics) -> None:
    watch.observe(policy_view(name, metrics))


def policy_view(name: str, metrics: StepMetrics) -> StepMetrics:
    """A policy's metrics of a step of several policies, under their own names."""
    prefix = f"{name}/"
    values = {k.removeprefix(prefix): v for k, v in metrics.values.items() if k.startswith(prefix)}
    notes = {k.removeprefix(prefix): v for k, v in metrics.notes.items() if k.startswith(prefix)}
    return StepMetrics(metrics.step, metrics.weight_version, values, notes)


def shared_generation_rates(stepped: dict[str, StepMetrics]) -> dict[str, float]:
    """Each policy's tokens per second of the batch's generation, which its policies share: the
    policy that ran the batch's episodes timed all of it, the others only the hand-over of their
    part (a rate over that would be meaningless). The generation's seconds are the longest any
    policy timed."""
    seconds = max((m.values.get(TIME_GENERATE_S, 0.0) for m in stepped.values()), default=0.0)
    rates = {}
    for name, metrics in stepped.items():
        rate, own = metrics.values.get(PERF_GEN_TOKENS_PER_S), metrics.values.get(TIME_GENERATE_S)
        if rate is not None and own is not None and seconds > 0:
            rates[name] = rate * max(own, 1e-9) / seconds  # its tokens (the rate's numerator) over the batch's time
    return rates


class PoliciesJob:
    """``postrl train`` with several policies as the step loop sees it: a step is every policy's
    step, one checkpoint holds them all."""

    command = "train"

    def __init__(self, policies: Policies, validator: Validator | None = None) -> None:
        self.policies = policies
        self.controllers = policies.controllers
        self.validator = validator  # logging.eval_every: the held-out episodes, after every policy's step

    @property
    def first(self) -> Components:
        return next(iter(self.policies.parts.values()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.policies.parts)

    @property
    def completed_steps(self) -> int:
        return min(c.step_count for c in self.controllers.values())

    def startup_lines(self) -> list[str]:
        """The policies and how calls reach them, then each policy's own lines, named."""
        config = self.policies.config
        agent = config.agent
        how = (
            f"seats {agent.seats}"
            if isinstance(agent, SeatedAgent)
            else "each call names its policy by model or base URL"
        )
        lines = [f"policies: {', '.join(self.names)} ({how})"]
        for name, parts in self.policies.parts.items():
            lines += [f"{name}: {line}" for line in policy_lines(parts, describe_accuracy(parts))]
        return lines

    def observers(self, echo: Callable[[str], None]) -> list[Observer]:
        """Each policy's watches, on its own metrics (``NAME/...`` without the name)."""
        observers: list[Observer] = []
        for name, parts in self.policies.parts.items():
            for watch in run_watches(parts.config, named_echo(name, echo), parts.numerics):
                observers.append(functools.partial(observe_policy, watch, name))
        return observers

    def close(self) -> None:
        self.policies.close()

    def step(self) -> StepMetrics:
        values: dict[str, float] = {}
        notes: dict[str, str] = {}
        stepped = {name: controller.step() for name, controller in self.controllers.items()}
        for name, rate in shared_generation_rates(stepped).items():
            stepped[name].values[PERF_GEN_TOKENS_PER_S] = rate
        for name, metrics in stepped.items():
            values.update({f"{name}/{key}": value for key, value in metrics.values.items()})
            notes.update({f"{name}/{key}": text for key, text in metrics.notes.items()})
        versions = {c.weight_version for c in self.controllers.values()}
        if self.validator is not None and self.validator.due(self.completed_steps):
            values.update(self.validate())
        return StepMetrics(self.completed_steps, min(versions), values, notes)

    def validate(self) -> dict[str, float]:
        """Each policy's ``val/*`` metrics (``NAME/val/...``) from one round of held-out episodes in
        which every policy acts with the weights of its step just done."""
        assert self.validator is not None
        began = time.perf_counter()
        ran: dict[int, PolicyRollouts] = {}
        values = {}
        for name, c in self.controllers.items():
            assert isinstance(c.source, PolicyEpisodes)
            view = HeldOutEpisodes(name, c.source, ran)
            values.update({f"{name}/{k}": v for k, v in self.validator.run(view, c.weight_version).items()})
        values[TIME_VALIDATE_S] = time.perf_counter() - began
        return values

    def restore_abandoned_step(self) -> bool:
        """Every policy back to the last completed step: False when one had started updating, or had
        completed the step (its update cannot be taken back)."""
        steps = {c.step_count for c in self.controllers.values()}
        restored = [c.restore_abandoned_step() for c in self.controllers.values()]
        return all(restored) and len(steps) == 1

    def checkpoint(self) -> Path:
        config = self.policies.config
        saved = {
            name: (c.parts.trainer, c.state_dict(), c.parts.tokenizer, c.parts.critic)
            for name, c in self.controllers.items()
        }
        return save_policies_checkpoint(config.run_dir, self.completed_steps, saved, config.checkpoint.keep_last)

    def save_final(self, folder: Path) -> None:
        """Each policy's model as a loadable folder, ``final_model/NAME``."""
        for name, c in self.controllers.items():
            c.parts.trainer.save_pretrained(folder / name)
            c.parts.tokenizer.save_pretrained(folder / name)
            how = trained_how(c.config, c.step_count) + f", as policy {name} of {len(self.controllers)}"
            chat = bool(c.parts.tokenizer.chat_template)
            write_model_card(folder / name, f"{c.config.name}: {name}", c.config.model.path, c.config.data, how, chat)

    def start(self, place: RunPlace, resume: bool, echo: Callable[[str], None]) -> int | None:
        """Every policy's weights pushed to its engines; a resumed run's from its latest checkpoint
        (the step it was saved at)."""
        if not resume:
            for c in self.controllers.values():
                c.start()
            return None
        checkpoint, state = resume_point(place, echo)
        for name, c in self.controllers.items():
            folder = checkpoint / "policies" / name
            c.parts.trainer.load_checkpoint(folder)
            if c.parts.critic is not None:
                c.parts.critic.load_checkpoint(folder / "critic")
            c.start(state["policies"][name])
        return self.completed_steps
