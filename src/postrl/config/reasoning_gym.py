"""``data.reasoning_gym``: procedural problems from the reasoning-gym library (``postrl[gym]``),
and ``data.eval_sets``: named held-out sets, each files or a reasoning-gym spec.

Everything that defines the problems (tasks, configs, sizes, seeds, levels, prompt wording) is
here, so the run's saved ``config.yaml`` regenerates exactly the same problems on resume.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from postrl.config.base import Section
from postrl.config.curriculum import CurriculumConfig

INSTRUCTIONS = {
    "tags": "Give your final answer inside <answer> and </answer> tags, for example <answer>42</answer>.",
    "last_number": "End your reply with the final answer as a number.",
}
GYM_EXTRA = "reasoning-gym is not installed: pip install 'postrl[gym]' (it pins the tested version)"


def check_task_name(name: str) -> str:
    """A reasoning-gym dataset name, checked against the installed library (which must be there)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(GYM_EXTRA) from None
    if name not in DATASETS:
        near = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.6)
        hint = f" (close: {', '.join(near)})" if near else ""
        raise ValueError(
            f"reasoning-gym has no task '{name}'{hint}; its {len(DATASETS)} tasks: reasoning_gym.factory.DATASETS"
        )
    return name


def max_level(task: str) -> int | None:
    """The task's last curriculum level (its longest attribute's), None when it has no curriculum."""
    from reasoning_gym.factory import CURRICULA, create_curriculum

    if task not in CURRICULA:
        return None
    return max(len(attr.levels) for attr in create_curriculum(task).attributes.values()) - 1


class GymTaskConfig(Section):
    name: str = Field(description="A reasoning-gym dataset name, e.g. chain_sum, leg_counting, gcd.")
    weight: float = Field(1.0, gt=0.0, description="Share of the problems (and of each batch's draws) from this task.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's own config fields (its dataclass, e.g. {min_terms: 2, max_terms: 3}); "
        "with a level, they override the curriculum's values.",
    )
    level: int | None = Field(
        None,
        ge=0,
        description="Start at this reasoning-gym curriculum level (the task's difficulty attributes at that "
        "level); None: the config alone. data.reasoning_gym.curriculum moves it during training.",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return check_task_name(v)

    @model_validator(mode="after")
    def _level_exists(self) -> GymTaskConfig:
        if self.level is not None:
            top = max_level(self.name)
            if top is None:
                raise ValueError(f"task '{self.name}' has no reasoning-gym curriculum: drop its level")
            if self.level > top:
                raise ValueError(f"task '{self.name}': level {self.level} is past its last level {top}")
        return self


class ReasoningGymConfig(Section):
    tasks: list[GymTaskConfig] = Field(min_length=1, description="The tasks mixed, each with its weight and config.")
    size: int = Field(1000, ge=1, description="Training problems over all tasks (per level, for a curriculum task).")
    seed: int = Field(0, ge=0, description="Seed of the training problems (each task's own seed derives from it).")
    val_size: int = Field(100, ge=0, description="Held-out problems over all tasks (0: none).")
    val_seed: int | None = Field(
        None,
        ge=0,
        description="Seed of the held-out problems; None: seed + 1. Held-out questions that also occur "
        "among the training questions are dropped (and counted) at start.",
    )
    answer_format: Literal["tags", "last_number"] = Field(
        "tags",
        description="Where the scorer finds the answer: tags, the last <answer>...</answer>; last_number, the "
        "last number in the response (for tasks whose answers are numbers; a model that does not use tags yet).",
    )
    instruction: str | None = Field(
        None,
        description="Appended to each question (a blank line between), saying the answer format; None: the "
        "answer_format's own sentence, '' none.",
    )
    system_prompt: str | None = Field(None, description="A system message before the question (None: none).")
    chat_template: bool = Field(True, description="Render the messages with the tokenizer's chat template.")
    curriculum: CurriculumConfig | None = Field(
        None,
        description="Move the level of each task that has one with its recent training accuracy "
        "(levels in the metrics as curriculum/<task>/level and in checkpoints).",
    )

    @model_validator(mode="after")
    def _distinct_and_leveled(self) -> ReasoningGymConfig:
        names = [t.name for t in self.tasks]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"tasks {doubled} are listed more than once")
        if self.curriculum is not None and all(t.level is None for t in self.tasks):
            raise ValueError("curriculum is set but no task has a level: give a task level: 0 to start from")
        return self

    @property
    def answer_instruction(self) -> str:
        return INSTRUCTIONS[self.answer_format] if self.instruction is None else self.instruction

    @property
    def held_out_seed(self) -> int:
        return self.seed + 1 if self.val_seed is None else self.val_seed


class EvalSetConfig(Section):
    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$", description="Reported as val/<name>/... and in postrl eval's table."
    )
    files: list[str] = Field(
        default_factory=list, description="JSONL or Parquet prompt files (scored with the run's reward)."
    )
    reasoning_gym: ReasoningGymConfig | None = Field(
        None, description="Or reasoning-gym problems: its tasks at val_size and val_seed (size is unused)."
    )
    size: int | None = Field(None, ge=1, description="Keep the first N prompts (None: all).")

    @model_validator(mode="after")
    def _one_source(self) -> EvalSetConfig:
        if bool(self.files) == (self.reasoning_gym is not None):
            raise ValueError(f"eval set '{self.name}': give exactly one of files and reasoning_gym")
        return self
