"""Episodes in lockstep: every running episode's turn in one batch, then their environments together.

Each turn waits for all the running episodes' turns, and the next waits for all their
environments: simple, and as fast as :class:`~postrl.rollout.agentic.individual.Individual` where
environments answer at once; slower where they take time. Episodes are not suspended by a
checkpoint (a turn the engines cut ends its episode ``suspended``), so none are resumed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from postrl.rollout.agentic.episode_ops import EnvT, EpisodeOps, Job, LiveT, StepT
from postrl.rollout.agentic.limited import log_close_failures, run_limited
from postrl.types import Rollout, SamplingParams
from postrl.types.episode import EpisodeState
from postrl.types.progress import phase


class Lockstep:
    def run(
        self,
        ops: EpisodeOps[LiveT, EnvT, StepT],
        jobs: list[Job],
        turn: SamplingParams,
        saved: list[EpisodeState] | None = None,
    ) -> list[Rollout]:
        if saved is not None:
            raise ValueError("lockstep episodes are not suspended, so none are resumed (agent.scheduling=individual)")
        limits = ops.limits
        resets: list[Callable[[], Any]] = [partial(ops.reset_env, p) for _, p in jobs]
        started = run_limited(resets, limits.env_timeout_s, limits.env_workers, "environment reset")
        try:
            episodes = [ops.start(job, outcome) for job, outcome in zip(jobs, started)]
            with phase("episodes", len(episodes), "episodes") as shown:
                shown.advance(done=sum(e.finish is not None for e in episodes))  # ended at their start
                while running := [e for e in episodes if e.finish is None]:
                    generated = self._turn(ops, running, turn)
                    shown.advance(done=sum(e.finish is not None for e in running), tokens=generated)
            return [r for e in episodes for r in ops.rollouts(e)]
        finally:  # unwinding (a stop signal, an error): closes get a second, not the whole time limit
            made = [o.value[0] for o in started if o.value is not None]
            log_close_failures(ops.close_envs(made, 1.0 if sys.exc_info()[0] else None), len(made))

    def suspend(self) -> None:
        """Nothing to ask: a turn the engines cut ends its episode."""

    @staticmethod
    def _turn(ops: EpisodeOps[LiveT, EnvT, StepT], running: list[LiveT], sampling: SamplingParams) -> int:
        """One model turn of every running episode (one batch per token budget), then every
        environment that has an answer to give; the tokens the turn generated."""
        generated = 0
        by_budget: dict[int, list[LiveT]] = {}
        for e in running:
            if budget := ops.budget(e):
                by_budget.setdefault(budget, []).append(e)
        for budget, group in by_budget.items():
            began = time.perf_counter()
            rollouts = ops.generate([ops.turn_prompt(e) for e in group], replace(sampling, max_tokens=budget))
            took = time.perf_counter() - began
            for e, r in zip(group, rollouts, strict=True):
                e.generate_s += took
                ops.record_generation(e, r)
            generated += sum(len(r.response_ids) for r in rollouts)
        stepping = [e for e in running if e.finish == "pending"]
        steps: list[Callable[[], Any]] = [partial(ops.step_env, e) for e in stepping]
        outcomes = run_limited(steps, ops.limits.env_timeout_s, ops.limits.env_workers, "environment step")
        for e, outcome in zip(stepping, outcomes, strict=True):
            e.env_s += outcome.seconds
            ops.observe(e, outcome)
        return generated
