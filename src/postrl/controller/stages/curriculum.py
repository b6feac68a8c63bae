"""The curriculum stage: each leveled task's difficulty follows its recent accuracy.

After a batch is scored (``select``), each task's samples join its window of recent correctness
(``curriculum.window`` samples); a full window at or above ``raise_at`` raises
the task's level by one, at or below ``lower_at`` lowers it, and empties the window. The levels
live in the prompt draw (:class:`~postrl.data.curriculum.LeveledDraw`), which generates the next
prompts at them; both are in checkpoints, so a resume continues at the same levels.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

from postrl.config.curriculum import CurriculumConfig
from postrl.controller.stages.base import Groups, Phase, Stage
from postrl.data.curriculum import LeveledDraw
from postrl.reward.accuracy import is_correct
from postrl.types.metric_names import curriculum_accuracy, curriculum_level


class Curriculum(Stage):
    name: ClassVar[str] = "curriculum"
    phases: ClassVar[tuple[Phase, ...]] = ("select",)

    def __init__(self, draw: LeveledDraw, config: CurriculumConfig, component: str, threshold: float) -> None:
        self.draw = draw
        self.config = config
        self.component = component
        self.threshold = threshold
        self.windows: dict[str, deque[bool]] = {t: deque(maxlen=config.window) for t in draw.leveled()}

    def observe(self, task: str, outcomes: list[bool]) -> None:
        """``outcomes`` join the task's window; a full window moves the level (and is emptied)."""
        window = self.windows[task]
        window.extend(outcomes)
        if len(window) < self.config.window:
            return
        level, top = self.draw.levels[task], self.draw.top[task]
        assert level is not None and top is not None
        rate = sum(window) / len(window)
        if rate >= self.config.raise_at and level < top:
            self.draw.set_level(task, level + 1)
            window.clear()
        elif rate <= self.config.lower_at and level > 0:
            self.draw.set_level(task, level - 1)
            window.clear()

    def select(self, groups: Groups) -> tuple[Groups, dict[str, float]]:
        by_task: dict[str, list[bool]] = {}
        for rollout, reward in zip(groups.rollouts, groups.rewards, strict=True):
            task = groups.prompts[rollout.prompt_index].task_type
            if task in self.windows:
                by_task.setdefault(task, []).append(is_correct(reward, self.component, self.threshold))
        for task, outcomes in by_task.items():
            self.observe(task, outcomes)
        metrics = {curriculum_level(t): float(self.draw.levels[t] or 0) for t in self.windows}
        metrics.update({curriculum_accuracy(t): sum(w) / len(w) for t, w in self.windows.items() if w})
        return groups, metrics

    def state_dict(self) -> dict[str, Any]:
        return {"windows": {t: list(w) for t, w in self.windows.items()}, "levels": dict(self.draw.levels)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for task, level in state["levels"].items():
            if task in self.windows and level is not None:
                self.draw.set_level(task, level)
        for task, outcomes in state["windows"].items():
            if task in self.windows:
                self.windows[task].extend(outcomes)
