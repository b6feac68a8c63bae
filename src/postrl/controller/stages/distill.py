"""On-policy distillation (``algorithm.distill``): every sampled token scored by the teacher of its
row's task, the per-token reverse-KL term the advantage stage adds."""

from __future__ import annotations

from pathlib import Path

import torch

from postrl.algorithms.distillation import reverse_kl_advantage, with_distillation
from postrl.config.distill import DistillConfig
from postrl.controller.failures import check_failure_rate
from postrl.controller.stages.base import Stage
from postrl.types import StepBatch
from postrl.types.metric_names import (
    DISTILL_CACHED,
    DISTILL_REVERSE_KL,
    DISTILL_TEACHER_CALLS_PER_SAMPLE,
    DISTILL_UNSCORABLE,
    DISTILL_UNTAUGHT,
    teacher_metric,
)
from postrl.types.teaching import TeacherFailure, TeacherQuery
from postrl.workers.roles import Teachers


class Distillation(Stage):
    """Before the advantages, sets ``step.teacher_logprobs``, ``step.distill`` (``weight x (teacher -
    student)`` on the tokens the model generated; the student's logprobs are the engine's, of the
    tokens it sampled) and ``step.taught``; after them, adds its term to each taught sample's
    advantage (or, ``task_reward: false``, puts it in the task's place). A sample whose teacher
    fails is unscorable, as a reward failure; a sample of a task no teacher applies to keeps its
    task advantage alone. Its seconds are ``time/distill_s``.
    Samples its teacher failed count against ``reward.max_failure_rate`` as reward failures do (a
    teacher gone for good stops the run, naming it, instead of training on nothing)."""

    name = "distill"
    phases = ("prepare", "after_advantage")

    def __init__(self, teachers: Teachers, config: DistillConfig, run_dir: Path, max_failure_rate: float) -> None:
        self.teachers = teachers
        self.config = config
        self.run_dir = run_dir
        self.max_failure_rate = max_failure_rate

    def prepare(self, step: StepBatch) -> dict[str, float]:
        owners = [self.config.teacher_for(step.prompts[r.prompt_index].task_type) for r in step.rollouts]
        taught_by = {row: owner for row, owner in enumerate(owners) if owner is not None and not step.unscorable[row]}
        rows = list(taught_by)
        queries = [
            TeacherQuery([*r.prompt_ids, *r.response_ids], len(r.prompt_ids))
            for r in (step.rollouts[row] for row in rows)
        ]
        answers, counts = self.teachers.logprobs(list(taught_by.values()), queries)
        teacher = torch.zeros_like(step.batch.old_logprobs)
        taught = torch.zeros(step.size, dtype=torch.bool)
        failed = 0
        for row, answer in zip(rows, answers, strict=True):
            if isinstance(answer, TeacherFailure):
                step.mark_unscorable(row, answer.reason)
                failed += 1
                continue
            teacher[row, step.spans[row]] = torch.tensor(answer, dtype=teacher.dtype)
            taught[row] = True
        step.teacher_logprobs, step.taught = teacher, taught
        if failed:
            number = int(step.times.get("batch", 0))
            check_failure_rate(self.run_dir, number, self.max_failure_rate, step.prompts, step.rollouts, step.results)
        step.distill = reverse_kl_advantage(step.batch.old_logprobs, teacher, step.model_mask, self.config.weight)
        return {
            **self._reverse_kl(step, owners),
            DISTILL_TEACHER_CALLS_PER_SAMPLE: sum(counts.asked.values()) / max(1, len(rows)),
            DISTILL_CACHED: float(counts.kept),
            DISTILL_UNSCORABLE: float(failed),
            DISTILL_UNTAUGHT: float(sum(owner is None for owner in owners)),
            **{teacher_metric(name, "samples"): float(n) for name, n in counts.asked.items()},
        }

    def after_advantage(self, step: StepBatch) -> dict[str, float]:
        assert step.distill is not None and step.taught is not None
        task = step.batch.advantages if self.config.task_reward else None
        step.set_advantages(with_distillation(task, step.distill, step.taught))
        return {}

    def _reverse_kl(self, step: StepBatch, owners: list[int | None]) -> dict[str, float]:
        """Student minus teacher logprob, mean over the taught tokens: overall and per teacher."""
        assert step.teacher_logprobs is not None and step.taught is not None
        gap = (step.batch.old_logprobs - step.teacher_logprobs) * step.model_mask
        out = {}
        for key, rows in [(DISTILL_REVERSE_KL, step.taught)] + [
            (teacher_metric(name, "reverse_kl"), step.taught & torch.tensor([o == i for o in owners]))
            for i, name in enumerate(self.teachers.names)
        ]:
            tokens = step.model_mask[rows].sum()
            if tokens > 0:
                out[key] = float(gap[rows].sum() / tokens)
        return out
