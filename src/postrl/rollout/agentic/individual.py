"""Episodes scheduled individually: each in a thread of its own, from its reset to its close.

An episode's turn goes to the engine the moment its environment has answered; while it waits on a
tool or an environment it holds no decode slot and delays no other episode. An engine that joins
concurrent calls batches the turns in flight continuously; for another one the turns waiting are
merged (:class:`~postrl.rollout.agentic.turn_batcher.TurnBatcher`). Environment calls run at most
``env_workers`` at a time, each within ``env_timeout_s``, and an episode's environment is closed as
soon as it ends.

Should one episode raise (a trajectory error, a bad prompt), the others stop after the call they
are in and the error is raised; each closes its environment on its way out.

A checkpoint of an async run suspends the engines: a turn that comes back ``suspended`` makes
every episode stop at its next turn boundary (one in an environment call finishes that call
first) and return a placeholder rollout holding its saved state (:class:`EpisodeState`, its
environment's ``state_dict`` included), which the runner's ``resume`` continues, after a
restart too. The cut turn is generated again from its start. An episode whose environment cannot
save its state is not suspended: it runs to its end.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from postrl.rollout.agentic.episode_ops import EnvT, EpisodeOps, Generate, Job, LiveT, StepT
from postrl.rollout.agentic.limited import Outcome, log_close_failures, run_limited
from postrl.rollout.agentic.turn_batcher import TurnBatcher
from postrl.types import Rollout, SamplingParams
from postrl.types.episode import EpisodeState
from postrl.types.progress import Phase, generated_tokens, phase


class _Stopped(Exception):
    """Another episode failed: this one stops where it is (its rollouts are not used)."""


@dataclass
class _Signals:
    suspend: threading.Event  # a checkpoint asked (suspend(), or the engines suspended a turn)
    env_calls: threading.Semaphore
    stop: threading.Event = field(default_factory=threading.Event)  # another episode failed
    close_failures: list[str] = field(default_factory=list)  # why closes failed, reported once per batch


class Individual:
    """Each episode in a thread of its own."""

    def __init__(self, joins_calls: bool = False, max_concurrent: int | None = None) -> None:
        """``joins_calls``: the engine batches concurrent calls itself (else the turns waiting are
        merged); ``max_concurrent``: episodes in flight at once (None: all of them)."""
        self.joins_calls = joins_calls
        self.max_concurrent = max_concurrent
        self.suspending = threading.Event()

    def suspend(self) -> None:
        self.suspending.set()

    def run(
        self,
        ops: EpisodeOps[LiveT, EnvT, StepT],
        jobs: list[Job],
        turn: SamplingParams,
        saved: list[EpisodeState] | None = None,
    ) -> list[Rollout]:
        if not jobs:
            return []
        self.suspending.clear()  # a suspend() asks the run in progress, not the next one
        generate: Generate = ops.generate if self.joins_calls else TurnBatcher(ops.generate)
        signals = _Signals(self.suspending, threading.Semaphore(ops.limits.env_workers))
        episode = partial(_in_thread, torch.get_num_threads(), partial(_run_episode, ops, generate, turn, signals))
        threads = min(len(jobs), self.max_concurrent or len(jobs))
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="postrl-episode")
        states: list[EpisodeState | None] = list(saved) if saved is not None else [None] * len(jobs)
        futures: list[Future[list[Rollout]]] = [
            pool.submit(episode, job, s) for job, s in zip(jobs, states, strict=True)
        ]
        try:
            with phase("episodes", len(jobs), "episodes") as shown:
                for future in futures:
                    future.add_done_callback(partial(_count, shown))
                while not all(f.done() for f in futures):
                    done, _ = wait(futures, timeout=1.0, return_when="FIRST_EXCEPTION")
                    failed = next((f for f in done if f.exception() is not None), None)
                    if failed is not None:
                        raise failed.exception()  # type: ignore[misc]
            return [r for f in futures for r in f.result()]
        finally:
            signals.stop.set()  # a no-op when all are done; otherwise the others stop after their current call
            pool.shutdown(wait=sys.exc_info()[0] is None, cancel_futures=True)
            log_close_failures(signals.close_failures, len(jobs))


def _count(shown: Phase, future: Future[list[Rollout]]) -> None:
    """A finished episode in the batch's progress, with the tokens the model generated in it."""
    rollouts = [] if future.cancelled() or future.exception() is not None else future.result()
    shown.advance(1, generated_tokens(rollouts))


def _in_thread(threads: int, run: Callable[..., list[Rollout]], *args: Any) -> list[Rollout]:
    """An episode's thread computes with as many torch threads as the run's caller (an async
    producer's 1, see ``controller.producer_threads``): a second multi-threaded OpenMP team slows
    the trainer's."""
    torch.set_num_threads(threads)
    return run(*args)


def _run_episode(
    ops: EpisodeOps[LiveT, EnvT, StepT],
    generate: Generate,
    turn: SamplingParams,
    signals: _Signals,
    job: Job,
    saved: EpisodeState | None,
) -> list[Rollout]:
    def limited(call: Callable[[], Any], what: str) -> Outcome[Any]:
        if signals.stop.is_set():
            raise _Stopped
        with signals.env_calls:
            return run_limited([call], ops.limits.env_timeout_s, 1, what)[0]

    made: EnvT | None
    if saved is None:
        started = limited(partial(ops.reset_env, job[1]), "environment reset")
        made = started.value[0] if started.value is not None else None
    else:
        restored = limited(partial(ops.restore_env, saved), "environment restore")
        if restored.error is not None:
            raise RuntimeError(f"a suspended episode ({saved.key}) could not be restored") from restored.error
        made = restored.value
    try:
        if saved is None:
            e = ops.start(job, started)
        else:
            assert made is not None
            e = ops.restored(job[0], saved, made)
        while e.finish is None:
            if signals.suspend.is_set() and (placeholder := ops.suspended(e)) is not None:
                return [placeholder]
            if not _one_turn(ops, generate, turn, signals, e):
                continue  # the engines suspended this turn: suspend here, or generate it again
            if e.finish != "pending":
                break
            outcome = limited(partial(ops.step_env, e), "environment step")
            e.env_s += outcome.seconds
            ops.observe(e, outcome)
        return ops.rollouts(e)
    finally:
        if made is not None:  # unwinding (another episode failed, a stop): a second, not the whole limit
            signals.close_failures.extend(ops.close_envs([made], 1.0 if sys.exc_info()[0] else None))


def _one_turn(
    ops: EpisodeOps[LiveT, EnvT, StepT], generate: Generate, turn: SamplingParams, signals: _Signals, e: LiveT
) -> bool:
    """The episode's next model turn, generated and recorded (or its end, where its context is
    full); False when the engines suspended it (nothing recorded)."""
    budget = ops.budget(e)
    if not budget:
        return True
    if signals.stop.is_set():
        raise _Stopped
    began = time.perf_counter()
    (r,) = generate([ops.turn_prompt(e)], replace(turn, max_tokens=budget))
    e.generate_s += time.perf_counter() - began
    if r.finish_reason == "suspended":
        signals.suspend.set()
        return False
    ops.record_generation(e, r)
    return True
