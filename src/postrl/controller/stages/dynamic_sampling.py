"""DAPO's dynamic sampling: keep the groups whose scorable rewards differ, and generate and score
more prompts until ``prompts_per_step`` groups are kept."""

from __future__ import annotations

import dataclasses

from postrl.controller.stages.base import Groups, Stage, StepServices
from postrl.types import Prompt, RewardResult, Rollout


class GroupSet:
    """Groups (a prompt and its samples) gathered over several generate rounds, re-indexed."""

    def __init__(self) -> None:
        self.prompts: list[Prompt] = []
        self.rollouts: list[Rollout] = []
        self.rewards: list[RewardResult] = []

    def add_informative(self, groups: Groups) -> int:
        """Add the groups whose scorable rewards are not all equal; return how many were dropped."""
        by_prompt: dict[int, list[int]] = {}
        for i, r in enumerate(groups.rollouts):
            by_prompt.setdefault(r.prompt_index, []).append(i)
        dropped = 0
        for index, members in sorted(by_prompt.items()):
            scores = {groups.rewards[i].reward for i in members if groups.rewards[i].reward is not None}
            if len(scores) < 2:
                dropped += 1
                continue
            new_index = len(self.prompts)
            self.prompts.append(groups.prompts[index])
            self.rollouts += [dataclasses.replace(groups.rollouts[i], prompt_index=new_index) for i in members]
            self.rewards += [groups.rewards[i] for i in members]
        return dropped

    def first(self, count: int) -> Groups:
        pairs = [(r, w) for r, w in zip(self.rollouts, self.rewards) if r.prompt_index < count]
        return Groups(self.prompts[:count], [r for r, _ in pairs], [w for _, w in pairs])


class DynamicSampling(Stage):
    """Up to ``max_extra_rounds`` more generate rounds per step; with no informative group at all
    the step trains on its first batch (whose advantages are 0)."""

    name = "dynamic_sampling"
    phases = ("select",)

    def __init__(self, services: StepServices, max_extra_rounds: int) -> None:
        self.services = services
        self.max_extra_rounds = max_extra_rounds

    def select(self, groups: Groups) -> tuple[Groups, dict[str, float]]:
        target, rounds = len(groups.prompts), 0
        kept = GroupSet()
        dropped = kept.add_informative(groups)
        while len(kept.prompts) < target and rounds < self.max_extra_rounds:
            rounds += 1
            more = self.services.sample_prompts()
            more_rollouts = self.services.generate(more)
            dropped += kept.add_informative(Groups(more, more_rollouts, self.services.score(more, more_rollouts)))
        metrics = {
            "dapo/extra_rounds": float(rounds),
            "dapo/dropped_groups": float(dropped),
            "dapo/kept_groups": float(min(len(kept.prompts), target)),
        }
        return (kept.first(target) if kept.prompts else groups), metrics
