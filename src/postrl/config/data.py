"""The ``data:`` section of a run: where its prompts come from (files, a built-in task or
reasoning-gym problems), how rows become prompts, and its held-out sets
(:mod:`postrl.data.prompt_source` reads it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from postrl.config.base import Section
from postrl.config.reasoning_gym import EvalSetConfig, ReasoningGymConfig

NO_HELD_OUT = (
    "set data.val_files or data.eval_sets (or train on a built-in data.task or data.reasoning_gym, whose held-out "
    "problems are used)"
)


CURRICULUM_NEEDS_ACCURACY = (
    "data.reasoning_gym.curriculum follows accuracy: the reward needs an accuracy component (type reasoning_gym, "
    "or one marked accuracy: true)"
)


class DataConfig(Section):
    task: str | None = Field(None, description="A built-in task name (see postrl.tasks); replaces train_files.")
    train_files: list[str] = Field(default_factory=list, description="JSONL or Parquet prompt files.")
    prompt_column: str = Field("prompt", description="Column holding a prompt string.")
    messages_column: str = Field("messages", description="Column holding a chat message list.")
    apply_chat_template: bool = Field(False, description="Also wrap string prompts as one user message.")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longer prompts are an error (or skipped). None: the model's context length minus "
        "rollout.max_tokens. A value whose sum with rollout.max_tokens exceeds the context is refused at start.",
    )
    on_bad_row: Literal["error", "skip"] = Field("error", description="Malformed or too-long rows: fail or skip+count.")
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch (seeded).")
    val_files: list[str] = Field(
        default_factory=list,
        description="Held-out JSONL or Parquet prompt files, scored "
        "greedily with the run's reward components every logging.eval_every steps (val/*). "
        "Empty: a built-in task's test split, else no validation.",
    )
    val_size: int | None = Field(None, ge=1, description="Validate on the first N held-out prompts (None: all).")
    reasoning_gym: ReasoningGymConfig | None = Field(
        None,
        description="Procedural problems from reasoning-gym (postrl[gym]): tasks, weights, configs, sizes, "
        "seeds; replaces task and train_files, and its held-out problems are the validation set.",
    )
    environment: bool = Field(
        False,
        description="The prompts are the agent's environment's own: an agent.verifiers environment's dataset, its "
        "eval split held out (set by itself for such a run; replaces task, train_files and reasoning_gym).",
    )
    eval_sets: list[EvalSetConfig] = Field(
        default_factory=list,
        description="Named held-out sets (files or reasoning-gym specs), validated every logging.eval_every "
        "steps beside the main one (val/<name>/...) and reported by postrl eval.",
    )

    @property
    def generates_prompts(self) -> bool:
        """The prompts are generated from seeds (reasoning-gym), not read from files or a task."""
        return self.reasoning_gym is not None

    def prompt_options(self) -> dict[str, Any]:
        """How rows become prompts: the keyword arguments of the dataset loaders."""
        return dict(
            prompt_column=self.prompt_column,
            messages_column=self.messages_column,
            apply_chat_template=self.apply_chat_template,
            max_prompt_tokens=self.max_prompt_tokens,
            on_bad_row=self.on_bad_row,
        )

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str | None) -> str | None:
        from postrl.tasks import get_task

        return None if v is None else get_task(v).name

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        given = [
            name
            for name, set_ in (
                ("task", self.task is not None),
                ("train_files", bool(self.train_files)),
                ("reasoning_gym", self.reasoning_gym is not None),
                ("environment", self.environment),
            )
            if set_
        ]
        if not given:
            raise ValueError("set data.task, data.train_files or data.reasoning_gym")
        if len(given) > 1:
            raise ValueError(f"set only one of data.{' and data.'.join(given)}")
        names = [s.name for s in self.eval_sets]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"eval_sets {doubled} are named more than once")
        return self
