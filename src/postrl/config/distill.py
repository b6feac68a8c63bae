"""``algorithm.distill``: on-policy distillation. The student samples; a frozen teacher gives the
logprob of every token the student sampled; each token's advantage gains
``weight x (teacher logprob - student logprob)``, the per-token reverse KL's negative (GKD with
lambda = 1). ``distill: {teacher: PATH_OR_URL}`` is short for one teacher that applies to every row."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from postrl.config.base import Section


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


class TeacherConfig(Section):
    source: str = Field(
        description="A Hugging Face model folder (run in this process, frozen, in train.device and the trainer's "
        "precision), or the base URL of an OpenAI-compatible server (postrl serve-rollout, vLLM: "
        "http://host:8000/v1) whose /completions returns prompt logprobs (echo with logprobs)."
    )
    name: str | None = Field(
        None, description="Names the teacher in metrics and errors (distill/NAME/...); default: teacher, teacher_1, ..."
    )
    model: str | None = Field(None, description="A URL teacher's model name in requests; default: the server's first.")
    applies_to: list[str] | None = Field(
        None,
        min_length=1,
        description="Only rows whose task_type column is one of these are distilled from this teacher; None: every "
        "row no other teacher claims. A row no teacher applies to trains on its task reward alone (counted in "
        "distill/untaught).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="A folder teacher's weights: float32, or bfloat16 for half the memory and a rounded score.",
    )
    timeout_s: float = Field(
        120.0, gt=0.0, description="A URL teacher's limit per request; past it the sample is unscorable."
    )
    api_key_env: str | None = Field(None, description="The environment variable holding a URL teacher's bearer token.")
    concurrency: int = Field(8, ge=1, description="A URL teacher's requests in flight at once.")


class DistillConfig(Section):
    teachers: list[TeacherConfig] = Field(
        min_length=1, description="The teachers; each row is distilled from the one whose applies_to names its task."
    )
    weight: float = Field(
        1.0, gt=0.0, description="Multiplies the per-token term teacher logprob - student logprob in the advantage."
    )
    task_reward: bool = Field(
        True,
        description="Add the distillation term to the task reward's advantage (true), or train on the distillation "
        "term alone (false; the reward is still computed, for accuracy and the console).",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_teacher(cls, data: Any) -> Any:
        if isinstance(data, dict) and "teacher" in data:
            data = dict(data)
            if "teachers" in data:
                raise ValueError("algorithm.distill: give teacher (one) or teachers (a list), not both")
            data["teachers"] = [{"source": data.pop("teacher")}]
        return data

    @model_validator(mode="after")
    def _teachers_apply_once(self) -> DistillConfig:
        names, claimed = set(), dict[str, str]()
        defaults = [i for i, t in enumerate(self.teachers) if t.applies_to is None]
        if len(defaults) > 1:
            raise ValueError(
                f"algorithm.distill.teachers[{defaults[1]}]: only one teacher may leave applies_to unset (it takes "
                "every row no other teacher names)"
            )
        for i, teacher in enumerate(self.teachers):
            name = self.name_of(i)
            if name in names:
                raise ValueError(f"algorithm.distill.teachers[{i}]: the name '{name}' is used twice")
            names.add(name)
            for task in teacher.applies_to or []:
                if task in claimed:
                    raise ValueError(
                        f"algorithm.distill.teachers[{i}].applies_to: task '{task}' is already taught by '{claimed[task]}'"
                    )
                claimed[task] = name
        return self

    def name_of(self, index: int) -> str:
        given = self.teachers[index].name
        return given or ("teacher" if index == 0 else f"teacher_{index}")

    def teacher_for(self, task_type: Any) -> int | None:
        """The index of the teacher of a row of ``task_type``: the one naming it, else the default; None: none."""
        for i, teacher in enumerate(self.teachers):
            if teacher.applies_to is not None and task_type in teacher.applies_to:
                return i
        return next((i for i, t in enumerate(self.teachers) if t.applies_to is None), None)
