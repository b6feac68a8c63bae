"""The reward section of a config: a list of typed components, discriminated by ``type``.

Each component type carries only its own fields (a ``code`` component its sandbox limits, a
``judge`` its URL, template and score pattern). The older ``reward.verifiable`` /
``model_path`` / ``weights`` / ``format_pattern`` / ``length_target_tokens`` fields are refused
with the same reward written as components.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from postrl.config.base import Section
from postrl.config.imports import import_callable


def _check_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{pattern!r} is not a valid regex: {exc}") from None
    return pattern


Regex = Annotated[str, AfterValidator(_check_regex)]


class SandboxConfig(Section):
    wall_s: float = Field(10.0, gt=0.0, description="Wall-clock limit for one program and all its tests.")
    cpu_s: int = Field(10, ge=1, description="CPU-time limit (RLIMIT_CPU).")
    memory_mb: int = Field(1024, ge=64, description="Address-space limit (RLIMIT_AS).")
    processes: int = Field(64, ge=1, description="Process limit for the sandbox user (RLIMIT_NPROC).")
    file_size_mb: int = Field(16, ge=1, description="Largest file the program may write (RLIMIT_FSIZE).")
    open_files: int = Field(64, ge=8, description="Open file descriptors (RLIMIT_NOFILE).")
    output_bytes: int = Field(1 << 20, ge=1024, description="stdout+stderr beyond this fails the run.")
    python_site: bool = Field(False, description="Let programs import installed packages (slower start).")


class _Component(Section):
    """What every reward term has; the reward is the weighted sum of the components that apply."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Reported as reward/<name>/mean.")
    weight: float = Field(1.0, description="Multiplies the component's value in the summed reward (any sign).")
    timeout_s: float | None = Field(None, gt=0.0, description="Per-sample limit; default reward.timeout_s.")
    applies_to: list[str] | None = Field(
        None,
        min_length=1,
        description="Only rows whose task_type column is one of these are scored by this "
        "component; None: every row. A row no component applies to is unscorable, naming its task_type.",
    )
    expected_range: tuple[float, float] | None = Field(
        None,
        description="[low, high] the values should lie in; a value outside is kept but flagged "
        "(reward/flagged metric, the sample's 'flags', a console note).",
    )
    accuracy: bool = Field(
        False,
        description="This component is the accuracy metric: a sample is correct when its value reaches "
        "reward.accuracy_threshold (at most one component; default: the first exact_match or math one).",
    )

    @model_validator(mode="after")
    def _range_in_order(self) -> _Component:
        if self.expected_range is not None and self.expected_range[0] > self.expected_range[1]:
            raise ValueError(
                f"reward component '{self.name}': expected_range {list(self.expected_range)} has low > high"
            )
        return self

    def applies(self, task_type: Any) -> bool:
        return self.applies_to is None or task_type in self.applies_to


class ExactMatchComponent(_Component):
    type: Literal["exact_match"] = Field(description="1 when the answer inside <answer> tags equals the reference.")
    answer_column: str = Field("answer", description="The column holding the reference answer.")


class MathComponent(_Component):
    type: Literal["math"] = Field(description="math-verify equivalence of the \\boxed{} or <answer> answer.")
    answer_column: str = Field("answer", description="The column holding the reference answer.")


class ReasoningGymComponent(_Component):
    type: Literal["reasoning_gym"] = Field(
        description="reasoning-gym's scorer on the <answer> extracted from the response (rows of data.reasoning_gym)."
    )
    scorer: Literal["reasoning_gym", "cascade"] = Field(
        "reasoning_gym",
        description="reasoning_gym: the task's own score_answer (no credit for merely containing the reference); "
        "cascade: all or nothing, exact, then whitespace/case, then numeric equality, then the task's full marks.",
    )


class CustomComponent(_Component):
    type: Literal["custom"] = Field(description="Your function score(prompt, response, **columns).")
    function: str = Field(description="'package.module:function' (a module next to the config imports as is).")

    @field_validator("function")
    @classmethod
    def _module_and_name(cls, v: str) -> str:
        if not re.fullmatch(r"[\w.]+:\w+", v):
            raise ValueError(f"function={v!r} must look like 'package.module:function'")
        import_callable(v, "function")
        return v


class CodeComponent(_Component):
    type: Literal["code"] = Field(description="The response's program against the row's tests in the sandbox.")
    tests_column: str = Field("tests", description="The column holding the tests.")
    code_score: Literal["fraction", "all_or_nothing"] = Field("fraction", description="How passed tests score.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Limits of each program run.")
    timeout_margin_s: float = Field(
        5.0,
        ge=0.0,
        description="Without timeout_s, a sample may take sandbox.wall_s plus this (interpreter start, "
        "jail set-up) before its worker is killed.",
    )


class RewardModelComponent(_Component):
    type: Literal["reward_model"] = Field(description="A local Hugging Face sequence-classification model.")
    path: str = Field(min_length=1, description="The reward model folder.")
    batch_size: int = Field(32, ge=1, description="Samples per forward pass.")


class RemoteRewardModelComponent(_Component):
    type: Literal["remote_reward_model"] = Field(description='POST url {"prompts", "responses"} -> {"scores"}.')
    url: str = Field(min_length=1, description="The scoring URL.")
    api_key_env: str | None = Field(None, description="Env var holding a bearer token.")
    max_concurrency: int = Field(8, ge=1, description="Requests in flight.")
    request_timeout_s: float = Field(60.0, gt=0.0, description="Per-request timeout.")


class JudgeComponent(_Component):
    type: Literal["judge"] = Field(description="An LLM judge over any OpenAI-compatible chat API.")
    url: str = Field(min_length=1, description="The API base URL (.../v1).")
    model: str = Field(min_length=1, description="The model name sent to the chat API.")
    api_key_env: str | None = Field(None, description="Env var holding a bearer token.")
    prompt_template: str = Field(
        "Rate the response to the question from 0 to 10.\nQuestion: {prompt}\nResponse: {response}\n"
        "Reply with 'Score: N'.",
        description="str.format template; fields prompt, response and the row's columns.",
    )
    score_pattern: Regex = Field(r"Score:\s*(-?\d+(?:\.\d+)?)", description="Regex whose group 1 is the score.")
    score_scale: float = Field(10.0, gt=0.0, description="The parsed score is divided by this.")
    max_concurrency: int = Field(8, ge=1, description="Requests in flight.")
    request_timeout_s: float = Field(60.0, gt=0.0, description="Per-request timeout.")


class FormatComponent(_Component):
    type: Literal["format"] = Field(description="1 when the whole response matches pattern, else 0.")
    pattern: Regex = Field(r"^\s*<answer>.*?</answer>\s*$", description="The regex (DOTALL).")


class LengthComponent(_Component):
    type: Literal["length"] = Field(description="-max(0, tokens - target) / target: a penalty past a length.")
    target_tokens: int = Field(ge=1, description="The response length the penalty starts after.")


class OverlongComponent(_Component):
    type: Literal["overlong"] = Field(
        description="DAPO's soft overlong penalty: 0, then down to -1 over the last "
        "cache_tokens before max_tokens, -1 beyond."
    )
    max_tokens: int = Field(ge=1, description="The response budget (usually rollout.max_tokens).")
    cache_tokens: int = Field(ge=1, description="The length of the soft zone before max_tokens.")

    @model_validator(mode="after")
    def _zone_fits(self) -> OverlongComponent:
        if self.cache_tokens > self.max_tokens:
            raise ValueError(f"cache_tokens={self.cache_tokens} must be <= max_tokens={self.max_tokens}")
        return self


RewardComponentConfig = Annotated[
    ExactMatchComponent
    | MathComponent
    | ReasoningGymComponent
    | CustomComponent
    | CodeComponent
    | RewardModelComponent
    | RemoteRewardModelComponent
    | JudgeComponent
    | FormatComponent
    | LengthComponent
    | OverlongComponent,
    Field(discriminator="type"),
]


class RemoteRewardConfig(Section):
    url: str = Field(description="Base URL of a `postrl serve-reward` server, e.g. http://127.0.0.1:8100.")
    token_env: str | None = Field(None, description="Env var holding the server's bearer token.")
    timeout_s: float = Field(120.0, gt=0.0, description="Per-request timeout.")
    retries: int = Field(4, ge=0, description="Retries on connection errors and 5xx answers.")
    backoff_s: float = Field(0.5, gt=0.0, description="First retry delay; doubled each retry, with jitter.")
    max_connections: int = Field(16, ge=1, description="Pooled HTTP connections.")
    batch_size: int = Field(256, ge=1, description="Samples per request.")


ACCURACY_KINDS = "reasoning_gym, exact_match, math, or one marked accuracy: true"  # the components that say correct


class RewardConfig(Section):
    components: list[RewardComponentConfig] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [ExactMatchComponent(name="correct", type="exact_match")],
        min_length=1,
        description="Named, weighted reward terms summed into the reward, each logged as reward/<name>/mean.",
    )

    @field_validator("components")
    @classmethod
    def _one_accuracy_component(cls, v: list[Any]) -> list[Any]:
        marked = [c.name for c in v if c.accuracy]
        if len(marked) > 1:
            raise ValueError(f"components {marked} are all marked accuracy: true; mark one")
        return v

    accuracy_threshold: float = Field(
        1.0,
        description="A sample counts as correct (the accuracy metric) when its accuracy component (the one "
        "marked accuracy: true, else the first math/exact_match one) reaches this value.",
    )
    timeout_s: float = Field(5.0, gt=0.0, description="Per-sample scoring timeout; the worker is killed past it.")
    num_workers: int = Field(2, ge=1, description="Scoring worker processes.")
    max_workers: int = Field(
        32,
        ge=1,
        description="Most scoring processes at once: a worker stuck on one sample longer than stall_after_s "
        "stops counting toward num_workers and another starts, so hanging samples time out together.",
    )
    stall_after_s: float = Field(0.25, gt=0.0, description="When a busy worker counts as stalled (see max_workers).")
    hang_limit: int = Field(
        4,
        ge=1,
        description="After this many timeouts in one batch with not one result, the batch's remaining "
        "samples fail at once (the function hangs on everything).",
    )
    remote: RemoteRewardConfig | None = Field(None, description="Score through a `postrl serve-reward` server.")
    max_failure_rate: float = Field(
        0.5, ge=0.0, le=1.0, description="Stop the run when a step has more unscorable samples than this fraction."
    )

    @model_validator(mode="after")
    def _unique_names(self) -> RewardConfig:
        names = [c.name for c in self.components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward.components: duplicate names {dupes}")
        return self
