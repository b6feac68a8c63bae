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
environment's ``state_dict`` included), which :meth:`EpisodeRunner.resume` continues, after a
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
from typing import TYPE_CHECKING, Any

import torch

from postrl.rollout.agentic.env import Environment, SavableEnvironment
from postrl.rollout.agentic.limited import Outcome, log_close_failures, run_limited
from postrl.rollout.agentic.turn_batcher import TurnBatcher
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.episode import EpisodeState

if TYPE_CHECKING:
    from postrl.rollout.agentic.chat import ChatRenderer
    from postrl.rollout.agentic.episodes import EpisodeRunner, Generate, LiveEpisode


class _Stopped(Exception):
    """Another episode failed: this one stops where it is (its rollouts are not used)."""


@dataclass
class _Signals:
    suspend: threading.Event  # a checkpoint asked (the runner's, or the engines suspended a turn)
    env_calls: threading.Semaphore
    stop: threading.Event = field(default_factory=threading.Event)  # another episode failed
    close_failures: list[str] = field(default_factory=list)  # why closes failed, reported once per batch


def run_individually(
    runner: EpisodeRunner,
    jobs: list[tuple[int, Prompt]],
    turn: SamplingParams,
    saved: list[EpisodeState] | None = None,
) -> list[Rollout]:
    """The rollouts of every job's episode, in job order; ``saved[i]``: job i continues that
    suspended episode instead of starting one."""
    if not jobs:
        return []
    runner.suspending.clear()  # a suspend() asks the run in progress, not the next one
    generate: Generate = runner.generate if runner.joins_calls else TurnBatcher(runner.generate)
    signals = _Signals(runner.suspending, threading.Semaphore(runner.env_workers))
    episode = partial(_in_thread, torch.get_num_threads(), partial(_run_episode, runner, generate, turn, signals))
    threads = min(len(jobs), runner.max_concurrent or len(jobs))
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="postrl-episode")
    states: list[EpisodeState | None] = list(saved) if saved is not None else [None] * len(jobs)
    futures: list[Future[list[Rollout]]] = [pool.submit(episode, job, s) for job, s in zip(jobs, states, strict=True)]
    try:
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


def _in_thread(threads: int, run: Callable[..., list[Rollout]], *args: Any) -> list[Rollout]:
    """An episode's thread computes with as many torch threads as the run's caller (an async
    producer's 1, see ``controller.producer_threads``): a second multi-threaded OpenMP team slows
    the trainer's."""
    torch.set_num_threads(threads)
    return run(*args)


def _run_episode(
    runner: EpisodeRunner,
    generate: Generate,
    turn: SamplingParams,
    signals: _Signals,
    job: tuple[int, Prompt],
    saved: EpisodeState | None,
) -> list[Rollout]:
    def limited(call: Callable[[], Any], what: str, timeout_s: float | None = None) -> Outcome[Any]:
        if signals.stop.is_set():
            raise _Stopped
        limit = runner.limits.env_timeout_s if timeout_s is None else timeout_s
        with signals.env_calls:
            return run_limited([call], limit, 1, what)[0]

    made: Environment | None
    if saved is None:
        started = limited(partial(runner.reset_env, job[1]), "environment reset")
        made = started.value[0] if started.value is not None else None
    else:
        restored = limited(partial(runner.restore_env, saved), "environment restore")
        if restored.error is not None:
            raise RuntimeError(f"a suspended episode ({saved.key}) could not be restored") from restored.error
        made = restored.value
    try:
        if saved is None:
            e = runner.start(job, started)
        else:
            assert made is not None
            e = runner.restored(job[0], saved, made)
        renderer = runner.renderer_for(e.env)
        while e.finish is None:
            if signals.suspend.is_set() and isinstance(e.env, SavableEnvironment):
                return [runner.suspended_rollout(e, runner.saved_state(e))]
            if not _one_turn(runner, generate, turn, signals, e, renderer):
                continue  # the engines suspended this turn: suspend here, or generate it again
            if e.finish != "pending":
                break
            outcome = limited(partial(runner.step_env, e), "environment step")
            e.env_s += outcome.seconds
            runner.observe(e, outcome, renderer)
        return runner.rollouts(e, renderer)
    finally:
        if made is not None:  # unwinding (another episode failed, a stop): a second, not the whole limit
            signals.close_failures.extend(runner.close_envs([made], 1.0 if sys.exc_info()[0] else None))


def _one_turn(
    runner: EpisodeRunner,
    generate: Generate,
    turn: SamplingParams,
    signals: _Signals,
    e: LiveEpisode,
    renderer: ChatRenderer,
) -> bool:
    """The episode's next model turn, generated and recorded (or its end, where its context is
    full); False when the engines suspended it (nothing recorded)."""
    budget = runner.budget(e)
    if not budget:
        return True
    if signals.stop.is_set():
        raise _Stopped
    began = time.perf_counter()
    (r,) = generate([runner.turn_prompt(e)], replace(turn, max_tokens=budget))
    e.generate_s += time.perf_counter() - began
    runner.check_trajectory(e, r)
    if r.finish_reason == "suspended":
        signals.suspend.set()
        return False
    runner.record_generation(e, r, renderer)
    return True
