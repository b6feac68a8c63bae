"""A seeded, shuffled, epoch-aware prompt sampler whose position is part of the run state, and the
prompt draws built on it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import torch

from postrl.rollout.streams import derive

if TYPE_CHECKING:
    from postrl.data.dataset import PromptDataset
    from postrl.types import Prompt


class PromptSampler:
    """Yields dataset indices epoch after epoch; each epoch's order is derived from (seed, epoch).

    Its whole state is ``(epoch, position)``, so saving and restoring it resumes exactly.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        if size <= 0:
            raise ValueError("cannot sample from an empty dataset")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=gen).tolist()

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position == self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._order_for(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"sampler state is for a dataset of {state['size']} prompts, this one has {self.size}")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._order_for(self.epoch)


def with_stream(prompt: Prompt, seed: int, drawn: int) -> Prompt:
    """The ``drawn``-th prompt of a run seeded ``seed``, naming the random stream its samples are
    drawn from (:mod:`postrl.rollout.streams`): the same draw samples alike, however it is batched."""
    return dataclasses.replace(prompt, stream=derive(seed, drawn))


class PromptDraw(Protocol):
    """Where a run's prompts come from, batch after batch; its state is saved in checkpoints."""

    @property
    def epoch(self) -> int: ...

    def next_prompts(self, count: int) -> list[Prompt]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DatasetDraw:
    """A fixed dataset's prompts in the order of a :class:`PromptSampler` (its state is the sampler's)."""

    def __init__(self, dataset: PromptDataset, seed: int, shuffle: bool) -> None:
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), seed=seed, shuffle=shuffle)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_prompts(self, count: int) -> list[Prompt]:
        s = self.sampler
        drawn = s.epoch * s.size + s.position  # prompts drawn before these: each epoch is whole
        picked = s.next_indices(count)
        return [with_stream(self.dataset[i], s.seed, drawn + k) for k, i in enumerate(picked)]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
