"""Training prompts of a reasoning-gym run whose tasks move between difficulty levels.

Each (task, level) has its own pool of problems (the task's share of ``data.reasoning_gym.size``,
generated when first drawn, from a seed of the run's seed, the task and the level) and its own
:class:`~postrl.data.sampler.PromptSampler`. Each prompt's task is drawn by weight from a
generator seeded with the run's seed and the number of prompts drawn so far, so the whole draw is
resumed from ``(drawn, levels, samplers)``.
"""

from __future__ import annotations

from typing import Any

import torch

from postrl.config.curriculum import CurriculumConfig
from postrl.config.reasoning_gym import ReasoningGymConfig, max_level
from postrl.data.dataset import DatasetError, PromptDataset
from postrl.data.reasoning_gym import build_gym_prompts, shares
from postrl.data.sampler import PromptSampler, with_stream
from postrl.types import Prompt


class LeveledDraw:
    def __init__(
        self, gym: ReasoningGymConfig, tokenizer: Any, max_prompt_tokens: int, seed: int, shuffle: bool
    ) -> None:
        self.gym = gym
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.tasks = {t.name: t for t in gym.tasks}
        self.sizes = dict(zip(self.tasks, shares(gym.tasks, gym.size), strict=True))
        self.levels: dict[str, int | None] = {t.name: t.level for t in gym.tasks}
        self.top = {t.name: max_level(t.name) if t.level is not None else None for t in gym.tasks}
        self.weights = torch.tensor([t.weight for t in gym.tasks], dtype=torch.float64)
        self.pools: dict[tuple[str, int | None], PromptDataset] = {}
        self.samplers: dict[tuple[str, int | None], PromptSampler] = {}
        self.drawn = 0

    @property
    def epoch(self) -> int:
        return max((s.epoch for s in self.samplers.values()), default=0)

    @property
    def curriculum(self) -> CurriculumConfig:
        """How the levels move (the data source's ``curriculum``)."""
        assert self.gym.curriculum is not None, "a leveled draw is made for a curriculum"
        return self.gym.curriculum

    def leveled(self) -> list[str]:
        """The tasks whose level can move."""
        return [name for name, level in self.levels.items() if level is not None]

    def set_level(self, task: str, level: int) -> None:
        top = self.top[task]
        if top is None or not 0 <= level <= top:
            raise ValueError(f"task '{task}' has no level {level} (levels 0..{top})")
        self.levels[task] = level

    def sampler(self, task: str) -> tuple[PromptDataset, PromptSampler]:
        key = (task, self.levels[task])
        if key not in self.pools:
            gym = self.gym.model_copy(update={"tasks": [self.tasks[task]]})
            pool = build_gym_prompts(
                gym,
                self.tokenizer,
                self.gym.seed,
                self.sizes[task],
                self.max_prompt_tokens,
                {task: key[1]} if key[1] is not None else None,
            )
            if not pool.prompts:
                raise DatasetError(
                    f"data.reasoning_gym task '{task}' at level {key[1]}: no prompt fits "
                    f"max_prompt_tokens={self.max_prompt_tokens}"
                )
            self.pools[key] = pool
            self.samplers.setdefault(key, PromptSampler(len(pool), self.seed, self.shuffle))
        return self.pools[key], self.samplers[key]

    def next_prompts(self, count: int) -> list[Prompt]:
        names = list(self.tasks)
        out = []
        for _ in range(count):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.drawn)
            task = names[int(torch.multinomial(self.weights, 1, generator=gen))]
            pool, sampler = self.sampler(task)
            out.append(with_stream(pool[sampler.next_indices(1)[0]], self.seed, self.drawn))
            self.drawn += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "drawn": self.drawn,
            "levels": dict(self.levels),
            "samplers": [[task, level, s.state_dict()] for (task, level), s in self.samplers.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = state["drawn"]
        for task, level in state["levels"].items():
            if task not in self.tasks:
                raise ValueError(
                    f"the checkpoint's curriculum has task '{task}', which data.reasoning_gym no longer lists"
                )
            self.levels[task] = level
        self.samplers = {}
        for task, level, sampler_state in state["samplers"]:
            sampler = PromptSampler(sampler_state["size"], self.seed, self.shuffle)
            sampler.load_state_dict(sampler_state)
            self.samplers[(task, level)] = sampler
