"""The in-process Reward Service: named, weighted reward components summed into one reward.

``reward = sum(weight_i * component_i)`` over the ``reward.components`` that apply to the row
(``applies_to`` against its ``task_type`` column). Verifiers (math, exact_match, custom functions, code)
run in killable worker processes; reward models and judges run here. When any component of a
sample raises, times out or returns None, the sample is *unscorable*: its reward is None, the
reasons are kept, and the advantage estimator leaves it out of its group.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from postrl.config.run import RewardConfig
from postrl.reward.components import PooledScorer, accuracy_component, component_type
from postrl.reward.pool import JobResult, ScoringPool
from postrl.types import Prompt, RewardResult, Score, ScoreRequest

log = logging.getLogger(__name__)


class LocalRewardService:
    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.components = list(config.components)
        self.sandbox_protections: dict[str, bool] | None = None
        self._pooled: dict[str, tuple[str, dict[str, Any], float]] = {}
        self._local: dict[str, Callable[[list[ScoreRequest]], list[Score]]] = {}
        self._closers: list[Callable[[], None]] = []
        for comp in self.components:
            kind = component_type(comp)
            scorer = kind.build(comp, self)
            if kind.pooled:
                assert isinstance(scorer, PooledScorer)
                self._pooled[comp.name] = (scorer.function, scorer.options, scorer.timeout_s)
            else:
                self._local[comp.name] = scorer  # type: ignore[assignment]
        preload = tuple(sorted({fn for fn, _, _ in self._pooled.values()}))
        self.pool = (
            ScoringPool(
                config.num_workers,
                config.timeout_s,
                preload=preload,
                max_workers=config.max_workers,
                stall_after_s=config.stall_after_s,
                hang_limit=config.hang_limit,
            )
            if self._pooled
            else None
        )
        self.accuracy_component = accuracy_component([(c.name, c.type, c.accuracy) for c in self.components])

    # -- what a component's builder may ask (postrl.reward.components.BuildContext) ----------------
    @property
    def default_timeout_s(self) -> float:
        return self.config.timeout_s

    def on_close(self, close: Callable[[], None]) -> None:
        self._closers.append(close)

    def sandbox_options(self) -> dict[str, Any]:
        """Probe the code sandbox's protections once; log and warn about the missing ones."""
        from postrl.reward.sandbox import probe_protections, warn_missing_protections

        protections = probe_protections()
        self.sandbox_protections = dict(protections.active)
        on = ", ".join(name for name, active in protections.active.items() if active)
        log.info("code sandbox protections active: %s", on)
        warn_missing_protections(protections)
        return {"namespaces": list(protections.namespaces), "user": list(protections.unprivileged_user or []) or None}

    # -- scoring ----------------------------------------------------------------------------------
    def score(self, prompt: str | Prompt, response: str, **columns: Any) -> RewardResult:
        return self.score_batch([ScoreRequest.of(prompt, response, columns)])[0]

    def score_batch(self, requests: list[ScoreRequest]) -> list[RewardResult]:
        rows = {
            c.name: [i for i, r in enumerate(requests) if c.applies(r.columns.get("task_type"))]
            for c in self.components
        }  # the rows each component scores (reward.components[].applies_to)
        pending = self._submit_pooled(requests, rows)  # the worker processes run while local scorers do
        scores: dict[str, dict[int, Score]] = {}
        for name, scorer in self._local.items():
            mine = [requests[i] for i in rows[name]]
            try:
                values = scorer(mine) if mine else []
            except Exception as exc:  # noqa: BLE001 - a broken scorer makes its samples unscorable, loudly
                log.exception("reward component %s failed", name)
                values = [(None, f"{type(exc).__name__}: {exc}")] * len(mine)
            scores[name] = dict(zip(rows[name], values))
        reasons: dict[str, dict[int, str | None]] = {}
        for name, futures in pending.items():
            results: list[JobResult] = [f.result() for f in futures]
            scores[name] = {i: (r.value, r.error) for i, r in zip(rows[name], results)}
            reasons[name] = {i: r.reason for i, r in zip(rows[name], results)}
        return [self._combine(i, requests[i], scores, reasons) for i in range(len(requests))]

    def _submit_pooled(self, requests: list[ScoreRequest], rows: dict[str, list[int]]) -> dict[str, list]:
        if self.pool is None:
            return {}
        pending = {}
        for name, (fn, options, timeout) in self._pooled.items():
            jobs = [
                {
                    "fn": fn,
                    "prompt": requests[i].prompt,
                    "response": requests[i].response,
                    "columns": requests[i].columns,
                    "options": options,
                    "timeout_s": timeout,
                }
                for i in rows[name]
            ]
            pending[name] = self.pool.submit(jobs) if jobs else []
        return pending

    def _combine(
        self,
        i: int,
        request: ScoreRequest,
        scores: dict[str, dict[int, Score]],
        reasons: dict[str, dict[int, str | None]],
    ) -> RewardResult:
        applying = [comp for comp in self.components if i in scores[comp.name]]
        if not applying:
            task = request.columns.get("task_type")
            return RewardResult(
                reward=None,
                error=f"no reward component applies to task_type {task!r} (see reward.components[].applies_to)",
            )
        components: dict[str, float] = {}
        errors: list[str] = []
        why = {name: reason for name, r in reasons.items() if (reason := r.get(i))}
        for comp in applying:
            value, error = scores[comp.name][i]
            if value is None:
                errors.append(f"{comp.name}: {error or 'no score'}")
            elif not math.isfinite(value):  # e.g. a reward model's NaN: never averaged into a reward
                errors.append(f"{comp.name}: returned {value} (not finite)")
            else:
                components[comp.name] = value
        flags = [
            f"{comp.name}: value {components[comp.name]:g} outside expected_range "
            f"[{comp.expected_range[0]:g}, {comp.expected_range[1]:g}]"
            for comp in applying
            if comp.expected_range is not None
            and comp.name in components
            and not comp.expected_range[0] <= components[comp.name] <= comp.expected_range[1]
        ]
        if errors:
            return RewardResult(reward=None, components=components, error="; ".join(errors), reasons=why, flags=flags)
        total = sum(comp.weight * components[comp.name] for comp in applying)
        return RewardResult(reward=total, components=components, reasons=why, flags=flags)

    def error_count(self) -> int:
        """Scoring workers lost or timed out in this run (each restarted; the samples are unscorable)."""
        return 0 if self.pool is None else self.pool.stats.restarts + self.pool.stats.timeouts

    def set_log_file(self, path: Any) -> None:
        """Where the scoring workers' stderr (reward functions' prints) goes: a file path."""
        if self.pool is not None:
            self.pool.set_log_file(path)

    def set_log_stream(self, stream: Any) -> None:
        """Send the scoring workers' stderr to an open binary stream (a server's own stderr)."""
        if self.pool is not None:
            self.pool.set_log_file(stream)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for close in self._closers:
            close()


def result_to_json(result: RewardResult) -> dict[str, Any]:
    return {**dataclasses.asdict(result), "unscorable": result.unscorable}
