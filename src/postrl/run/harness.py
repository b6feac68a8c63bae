"""The evaluation harness behind ``postrl eval``: named held-out sets answered greedily and with
n samples per prompt, scored by the run's reward, reported per set and per task as greedy accuracy,
mean@n, pass@k and maj@k (:mod:`postrl.run.eval_metrics`), as a table and as JSON. An ``agent:``
run's answers are whole episodes of its environment (or agent function), through the same batch
source training uses; an episode that failed counts as a wrong answer and is reported as unscorable."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from postrl.controller.source import BatchSource
from postrl.data.dataset import PromptDataset
from postrl.reward.accuracy import is_correct, stated_answer
from postrl.run.eval_metrics import maj_at_k, pass_at_k
from postrl.types import Prompt, RewardResult, Rollout, SamplingParams

ALL_TASKS = "(all)"


@dataclass
class Figures:
    """One set's (or one task's) figures; None where not measured (no sampling, or no accuracy)."""

    prompts: int
    greedy: float | None = None
    mean_at_n: float | None = None
    pass_at: dict[int, float] = field(default_factory=dict)
    maj_at: dict[int, float] = field(default_factory=dict)
    unscorable: int = 0  # answers (greedy and sampled) that could not be scored: counted as wrong
    answers: int = 0  # answers scored or not: prompts x (1 greedy + n samples)

    def as_json(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "greedy": self.greedy,
            "mean_at_n": self.mean_at_n,
            "pass_at_k": {str(k): v for k, v in self.pass_at.items()},
            "maj_at_k": {str(k): v for k, v in self.maj_at.items()},
            "unscorable": self.unscorable,
        }


@dataclass
class PromptOutcome:
    """One prompt's answers: greedy correct or not, its n samples' extracted answers and scores, and
    why any of them could not be scored."""

    task: str | None
    greedy: bool | None = None
    answers: list[str | None] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def figures(outcomes: list[PromptOutcome], ks: list[int], votes: bool = True) -> Figures:
    """The outcomes' figures; maj@k only where answers can be ``votes`` (an environment's reward
    has no answer to vote on: n/a, not 0)."""
    out = Figures(prompts=len(outcomes))
    if not outcomes:
        return out
    out.unscorable = sum(len(o.errors) for o in outcomes)
    out.answers = sum((o.greedy is not None) + len(o.correct) for o in outcomes)
    if outcomes[0].greedy is not None:
        out.greedy = sum(bool(o.greedy) for o in outcomes) / len(outcomes)
    if outcomes[0].correct:
        n = len(outcomes[0].correct)
        out.mean_at_n = sum(sum(o.correct) / n for o in outcomes) / len(outcomes)
        out.pass_at = {k: sum(pass_at_k(n, sum(o.correct), k) for o in outcomes) / len(outcomes) for k in ks}
        if votes:
            out.maj_at = {k: sum(maj_at_k(o.answers, o.correct, k) for o in outcomes) / len(outcomes) for k in ks}
    return out


@dataclass
class SetReport:
    name: str
    overall: Figures
    per_task: dict[str, Figures]
    errors: Counter[str] = field(default_factory=Counter)  # why answers could not be scored, by count

    def as_json(self) -> dict[str, Any]:
        return {**self.overall.as_json(), "per_task": {t: f.as_json() for t, f in self.per_task.items()}}

    def unscorable_line(self) -> str | None:
        """One line when some answers could not be scored (they count as wrong), with the commonest reason."""
        if not self.overall.unscorable:
            return None
        reason, times = self.errors.most_common(1)[0]
        return (
            f"{self.name}: {self.overall.unscorable} of {self.overall.answers} answers could not be scored and "
            f"count as wrong (most common: {times}x {reason})"
        )


def answer_of(prompt: Prompt, rollout: Rollout) -> str | None:
    """The answer a response gives, for majority votes (:func:`~postrl.reward.accuracy.stated_answer`);
    an episode's answer is its last assistant message's."""
    response = rollout.text
    if rollout.episode is not None:
        said = [m.get("content") or "" for m in rollout.episode.messages if m.get("role") == "assistant"]
        response = said[-1] if said else ""
    return stated_answer(response, prompt.columns)


class Harness:
    """Answers and scores held-out sets through one batch source: the engine and the Reward
    Service, or an ``agent:`` run's episodes. ``votes``: whether answers can be majority-voted
    (not an environment's own reward)."""

    def __init__(
        self,
        source: BatchSource,
        component: str,
        threshold: float,
        greedy: SamplingParams,
        sampling: SamplingParams | None,
        votes: bool = True,
    ) -> None:
        self.source = source
        self.component = component
        self.threshold = threshold
        self.greedy = greedy
        self.sampling = sampling
        self.votes = votes

    def outcomes(self, prompts: list[Prompt]) -> list[PromptOutcome]:
        """Greedy answers, then (with ``sampling``) its ``n`` samples per prompt."""
        outcomes = [PromptOutcome(task=p.task_type if isinstance(p.task_type, str) else None) for p in prompts]
        for rollout, result in self.answer(prompts, self.greedy):
            outcome = outcomes[rollout.prompt_index]
            outcome.greedy = is_correct(result, self.component, self.threshold)
            outcome.errors.extend([result.error or "unscorable"] if result.reward is None else [])
        if self.sampling is not None:
            for rollout, result in self.answer(prompts, self.sampling):
                outcome = outcomes[rollout.prompt_index]
                outcome.answers.append(answer_of(prompts[rollout.prompt_index], rollout))
                outcome.correct.append(is_correct(result, self.component, self.threshold))
                outcome.errors.extend([result.error or "unscorable"] if result.reward is None else [])
        return outcomes

    def answer(self, prompts: list[Prompt], sampling: SamplingParams) -> list[tuple[Rollout, RewardResult]]:
        """Each answer with its score; an episode split into several training samples is one answer
        (its first sample, which carries the episode)."""
        ran = self.source.generate(prompts, sampling, None)
        rollouts = [r for r in ran if r.episode is None or r.episode.part == 0]
        return list(zip(rollouts, self.source.score(prompts, rollouts), strict=True))

    def report(self, name: str, dataset: PromptDataset, ks: list[int]) -> SetReport:
        outcomes = self.outcomes(dataset.prompts)
        tasks = sorted({o.task for o in outcomes if o.task is not None})
        per_task = {t: figures([o for o in outcomes if o.task == t], ks, self.votes) for t in tasks}
        errors = Counter(e for o in outcomes for e in o.errors)
        return SetReport(name, figures(outcomes, ks, self.votes), per_task, errors)


NO_VOTES = (
    "maj@k is n/a: the episodes' rewards come from their environment or agent function, which give a score but "
    "no stated answer to vote on (pass@k and mean@n count those rewards)"
)


def table(reports: list[SetReport], ks: list[int], n: int, votes: bool = True) -> str:
    """One row per set and per task: prompts, greedy, mean@n, pass@k..., maj@k...; a line saying
    why maj@k is n/a where answers cannot be ``votes``."""
    head = ["set", "task", "prompts", "greedy"]
    if n:
        head += [f"mean@{n}", *(f"pass@{k}" for k in ks), *(f"maj@{k}" for k in ks)]

    def cells(f: Figures) -> list[str]:
        values = [f.greedy]
        if n:
            values += [f.mean_at_n, *(f.pass_at.get(k) for k in ks), *(f.maj_at.get(k) for k in ks)]
        return [str(f.prompts)] + ["n/a" if v is None else f"{v:.3f}" for v in values]

    rows = [head]
    for report in reports:
        rows.append([report.name, ALL_TASKS, *cells(report.overall)])
        rows.extend([report.name, task, *cells(f)] for task, f in report.per_task.items())
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [line for r in reports if (line := r.unscorable_line()) is not None]
    return "\n".join(lines + ([NO_VOTES] if n and ks and not votes else []))
