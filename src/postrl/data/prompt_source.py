"""Where a run's prompts come from, whatever ``data:`` names: files, a built-in task or reasoning-gym.

One :class:`PromptSource` answers the three questions a run asks of its data: the training prompts
(:meth:`~PromptSource.train`), the held-out ones (:meth:`~PromptSource.held_out`: ``data.val_files``
where given, else the source's own held-out problems, the first ``data.val_size``) and the order it
draws them in (:meth:`~PromptSource.draw`: the training set in a seeded order, or, for a
reasoning-gym curriculum, problems generated at each task's level). Training, validation and
``postrl eval`` all ask it; :func:`prompt_source` is the one place that looks at which kind it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from postrl.config.agent import AgentBase, VerifiersAgent
from postrl.config.data import DataConfig
from postrl.config.reasoning_gym import EvalSetConfig
from postrl.data.curriculum import LeveledDraw
from postrl.data.dataset import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DatasetError,
    PromptDataset,
    build_prompts,
    load_prompt_dataset,
)
from postrl.data.reasoning_gym import build_gym_prompts, gym_held_out
from postrl.data.sampler import DatasetDraw, PromptDraw
from postrl.tasks import task_rows

Echo = Callable[[str], None]
HELD_OUT = "heldout"  # the main held-out set's name in postrl eval's table (a built-in task's: its name)


class PromptSource:
    """The files-only source; the others add their own training and held-out prompts."""

    def __init__(self, data: DataConfig, tokenizer: Any) -> None:
        self.data = data
        self.tokenizer = tokenizer
        self._train: PromptDataset | None = None

    @property
    def max_prompt_tokens(self) -> int:
        return self.data.max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS

    def options(self) -> dict[str, Any]:
        return {**self.data.prompt_options(), "max_prompt_tokens": self.max_prompt_tokens}

    def train(self) -> PromptDataset:
        """The training prompts, read (or generated) once."""
        if self._train is None:
            self._train = self._read_train()
        return self._train

    def _read_train(self) -> PromptDataset:
        return load_prompt_dataset(self.data.train_files, self.tokenizer, **self.options())

    def held_out(self, echo: Echo = print) -> PromptDataset | None:
        """``data.val_files``, else the source's own held-out prompts; the first ``data.val_size``.
        None: the run has none. ``echo``: where it says what it generated or dropped."""
        d = self.data
        if d.val_files:
            dataset: PromptDataset | None = load_prompt_dataset(d.val_files, self.tokenizer, **self.options())
        else:
            dataset = self._own(echo)
        if dataset is not None and d.val_size is not None:
            dataset.prompts = dataset.prompts[: d.val_size]
        return dataset

    def _own(self, echo: Echo) -> PromptDataset | None:
        return None

    @property
    def held_out_name(self) -> str:
        """The held-out set's name in ``postrl eval``'s table."""
        return HELD_OUT

    def draw(self, seed: int) -> PromptDraw:
        """The training prompts in a seeded order, epoch after epoch (reshuffled with ``data.shuffle``)."""
        return DatasetDraw(self.train(), seed, self.data.shuffle)


class BuiltinTask(PromptSource):
    """``data.task``: a built-in task's train split; its test split is held out."""

    @property
    def task(self) -> str:
        assert self.data.task is not None
        return self.data.task

    def _read_train(self) -> PromptDataset:
        return build_prompts(iter(task_rows(self.task, "train")), self.tokenizer, **self.options())

    def _own(self, echo: Echo) -> PromptDataset:
        return build_prompts(iter(task_rows(self.task, "test")), self.tokenizer, **self.options())

    @property
    def held_out_name(self) -> str:
        return HELD_OUT if self.data.val_files else self.task


class GeneratedProblems(PromptSource):
    """``data.reasoning_gym``: problems generated from seeds; the held-out ones (``val_seed``) are
    checked disjoint from every training problem; a curriculum draws at each task's level."""

    def _read_train(self) -> PromptDataset:
        gym = self.data.reasoning_gym
        assert gym is not None
        return build_gym_prompts(
            gym, self.tokenizer, gym.seed, gym.size, self.max_prompt_tokens, None, self.data.on_bad_row
        )

    def _own(self, echo: Echo) -> PromptDataset | None:
        gym = self.data.reasoning_gym
        assert gym is not None
        if not gym.val_size:
            return None
        where = "data.reasoning_gym"
        return gym_held_out(gym, self.tokenizer, self.max_prompt_tokens, where, echo, self.data.on_bad_row)

    def draw(self, seed: int) -> PromptDraw:
        gym = self.data.reasoning_gym
        assert gym is not None
        if gym.curriculum is None:
            return super().draw(seed)
        return LeveledDraw(gym, self.tokenizer, self.max_prompt_tokens, seed, self.data.shuffle)


class EnvironmentRows(PromptSource):
    """``data.environment``: an ``agent.verifiers`` environment's own dataset; its eval split is held
    out (none when it has none: verifiers' fallback to the training rows is not taken)."""

    def __init__(self, data: DataConfig, tokenizer: Any, agent: VerifiersAgent) -> None:
        super().__init__(data, tokenizer)
        self.agent = agent

    def _rows(self, split: Literal["train", "eval"]) -> PromptDataset | None:
        from postrl.rollout.agentic.verifiers_env import environment_rows, load_environment

        rows = list(environment_rows(load_environment(self.agent), split))
        return build_prompts(iter(rows), self.tokenizer, **self.options()) if rows else None

    def _read_train(self) -> PromptDataset:
        dataset = self._rows("train")
        if dataset is None or not dataset.prompts:
            raise DatasetError(
                f"agent.verifiers={self.agent.verifiers!r}: the environment's dataset has no usable rows"
            )
        return dataset

    def _own(self, echo: Echo) -> PromptDataset | None:
        return self._rows("eval")

    @property
    def held_out_name(self) -> str:
        return f"{self.agent.verifiers} eval"


class GivenPrompts(PromptSource):
    """Prompts already in hand (a test's, a benchmark's): trained on as given; ``data.val_files``
    or nothing held out."""

    def __init__(self, dataset: PromptDataset, data: DataConfig, tokenizer: Any = None) -> None:
        super().__init__(data, tokenizer)
        self._train = dataset


def prompt_source(data: DataConfig, tokenizer: Any, agent: AgentBase | None = None) -> PromptSource:
    """The source ``data:`` names (exactly one of task, train_files, reasoning_gym and environment
    is set; ``agent``: the run's, whose environment's rows ``data.environment`` means)."""
    if data.environment:
        if not isinstance(agent, VerifiersAgent):
            raise DatasetError("data.environment: the prompts of an environment's own dataset need agent.verifiers")
        return EnvironmentRows(data, tokenizer, agent)
    if data.task is not None:
        return BuiltinTask(data, tokenizer)
    if data.reasoning_gym is not None:
        return GeneratedProblems(data, tokenizer)
    return PromptSource(data, tokenizer)


def load_eval_set(spec: EvalSetConfig, data: DataConfig, tokenizer: Any, echo: Echo = print) -> PromptDataset:
    """One of ``data.eval_sets``: its files, or its held-out reasoning-gym problems; its first ``size``."""
    tokens = data.max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS
    if spec.reasoning_gym is not None:
        where = f"data.eval_sets[{spec.name}]"
        dataset = gym_held_out(spec.reasoning_gym, tokenizer, tokens, where, echo, data.on_bad_row)
    else:
        dataset = load_prompt_dataset(spec.files, tokenizer, **{**data.prompt_options(), "max_prompt_tokens": tokens})
    if spec.size is not None:
        dataset.prompts = dataset.prompts[: spec.size]
    return dataset
