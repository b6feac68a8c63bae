"""What :func:`postrl.run.train_runner.train` drives, for one policy or several: a :class:`RunJob`.

``train`` is one body for every RL run (checks, the run directory, start-up lines, the step loop,
clean-up); the job is where one policy (:class:`TrainJob`, one Controller) and several
(:class:`postrl.run.policies_runner.PoliciesJob`, a Controller each over shared episodes) differ:
how they start or resume, their checkpoints and final models, and how each policy's watches see
its own metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from postrl.controller.components import Components
from postrl.controller.controller import Controller
from postrl.run.checkpoint import save_checkpoint
from postrl.run.lifecycle import SteppedJob, resume_point
from postrl.run.model_card import trained_how, write_model_card
from postrl.run.place import RunPlace
from postrl.run.validation import Validator
from postrl.run.watch import EXACT_MODE, describe_placement, run_watches
from postrl.types import StepMetrics

Observer = Callable[[StepMetrics], None]


class RunJob(SteppedJob, Protocol):
    """A ``postrl train`` run as :func:`~postrl.run.train_runner.train` sees it."""

    controllers: dict[str, Controller]  # each policy's ('' for a run's one policy)

    @property
    def first(self) -> Components:
        """The first policy's parts (the prompts and the reward service are the run's)."""
        ...

    @property
    def names(self) -> tuple[str, ...]:
        """The policies' names as the console shows them (none for one policy)."""
        ...

    def startup_lines(self) -> list[str]: ...

    def observers(self, echo: Callable[[str], None]) -> list[Observer]:
        """What watches each step: every policy's watches (and a one-policy run's validation)."""
        ...

    def start(self, place: RunPlace, resume: bool, echo: Callable[[str], None]) -> int | None:
        """Weights pushed to the engines; a resumed run's from its latest checkpoint (its step)."""
        ...

    def close(self) -> None: ...


def policy_lines(parts: Components, accuracy: str) -> list[str]:
    """One policy's start-up lines: where its workers run, its numerics, exact mode, its accuracy."""
    config = parts.config
    lines = [describe_placement(config)]
    if parts.numerics is not None:
        lines.append(f"numerics: {parts.numerics.describe()}")
    if config.rollout.exact:
        lines.append(EXACT_MODE)
    return [*lines, accuracy]


def describe_accuracy(parts: Components) -> str:
    """Which number the run's ``accuracy`` is, said once at the start."""
    config, component = parts.config, parts.reward.accuracy_component
    if not config.scores_with_components:
        return f"accuracy: the environment's reward >= {config.reward.accuracy_threshold:g}"
    if component is None:
        return "accuracy: none (no exact_match or math component; mark one component accuracy: true to report one)"
    return f"accuracy: reward component '{component}' >= {config.reward.accuracy_threshold:g}"


def close_components(parts: Components) -> None:
    """Stop every worker, then the scheduler (a Ray instance started for the run ends here)."""
    try:
        for part in (parts.reward, parts.rollout, parts.trainer, parts.critic, parts.buffer, parts.teachers):
            if part is not None:
                part.close()
    finally:
        if parts.scheduler is not None:
            parts.scheduler.close()


class TrainJob:
    """One policy: the Controller's steps, and its checkpoints."""

    command = "train"

    def __init__(self, parts: Components, validator: Validator | None) -> None:
        self.parts = parts
        self.controller = Controller(parts)
        self.controllers = {"": self.controller}
        self.validator = validator

    @property
    def first(self) -> Components:
        return self.parts

    @property
    def names(self) -> tuple[str, ...]:
        return ()

    @property
    def completed_steps(self) -> int:
        return self.controller.step_count

    def startup_lines(self) -> list[str]:
        return policy_lines(self.parts, describe_accuracy(self.parts))

    def observers(self, echo: Callable[[str], None]) -> list[Observer]:
        c, validator = self.controller, self.validator
        observers: list[Observer] = []
        if validator is not None:
            observers.append(lambda m: validator.observe(m, c.source, c.batches.generation_version))
        return observers + [w.observe for w in run_watches(c.config, echo, self.parts.numerics)]

    def start(self, place: RunPlace, resume: bool, echo: Callable[[str], None]) -> int | None:
        if not resume:
            self.controller.start()
            return None
        checkpoint, state = resume_point(place, echo)
        self.parts.trainer.load_checkpoint(checkpoint)
        if self.parts.critic is not None:
            self.parts.critic.load_checkpoint(checkpoint / "critic")
        self.controller.start(state)
        return self.controller.step_count

    def step(self) -> StepMetrics:
        return self.controller.step()

    def restore_abandoned_step(self) -> bool:
        return self.controller.restore_abandoned_step()

    def checkpoint(self) -> Path:
        c, parts = self.controller, self.parts
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

    def close(self) -> None:
        try:
            self.controller.close()
        finally:
            close_components(self.parts)
