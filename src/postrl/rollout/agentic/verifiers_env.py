"""``agent.verifiers``: a verifiers environment (prime-rl's environment library), unmodified.

The environment is loaded once per process (:func:`load_environment`): an installed environment
package by its id through verifiers' own loader, or ``module:function``. Its dataset and eval split
are the run's prompts (:class:`postrl.data.prompt_source.EnvironmentRows`); this module plays them.

For each prompt :class:`VerifiersGroups` does what verifiers' own ``Environment.run_group`` does,
with one difference: every one of the ``n`` rollouts gets its own OpenAI client, whose base URL is
its episode's on the run's recording server (:mod:`postrl.rollout.agentic.recorder`), so each
rollout's calls are recorded apart and every trained token is exactly the engine's. The rollouts
run concurrently (``asyncio.gather`` of ``env.rollout``), then the rubric scores the group
(``rubric.score_group``: reward functions, weights, parsers, group reward functions), then each
state is cleaned up. The rubric's reward is the episode's; its functions' values are the episode's
``metrics``.

verifiers scores a reward function that raises (or returns what ``float`` refuses) as 0.0 and only
logs it. Here each reward function is wrapped (:func:`guard_rubric`, the same signature and name,
the same value) so that such a failure makes the group's episodes unscorable, naming the function.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import math
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import Any, Literal

from postrl.config.agent import VerifiersAgent, missing_environment
from postrl.config.imports import import_callable
from postrl.config.run import ConfigError
from postrl.rollout.agentic.agent_function import RecordingEndpoint
from postrl.rollout.agentic.limited import Outcome, failure_info, run_limited
from postrl.rollout.agentic.recorder import RecordedEpisode
from postrl.rollout.agentic.trajectory import failed_rollout
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.progress import phase

VERIFIERS_EXTRA = "agent.verifiers needs verifiers: pip install 'postrl[verifiers]'"
ROW_COLUMN = "verifiers_row"  # a prompt's column holding its dataset row, as the environment gave it


class VerifiersLoadError(ConfigError):
    """The environment could not be loaded: not installed, its loader raised, or not an Environment."""


class RubricFunctionError(RuntimeError):
    """A reward function of the environment's rubric raised or returned something other than a number."""


@functools.cache
def verifiers() -> Any:
    """The ``verifiers`` package, its log records handed to the root logger (verifiers gives its
    logger a stderr handler of its own at import): a run sends them to its agent output log."""
    try:
        import verifiers as vf
    except ImportError:
        raise VerifiersLoadError(VERIFIERS_EXTRA) from None
    vf.setup_logging(None)  # no handler of its own
    logging.getLogger("verifiers").propagate = True
    return vf


def load_environment(agent: VerifiersAgent) -> Any:
    """The environment ``agent.verifiers`` names, made with ``agent.verifiers_args``: once per
    process for a spec and its arguments (the prompt source and the episodes share it)."""
    return _loaded(agent.verifiers, json.dumps(agent.verifiers_args, sort_keys=True, default=repr))


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """The OpenAI tool schemas of the tools ``env`` declares at load (a ToolEnv's, a
    StatefulToolEnv's visible ones): none for an environment without tools."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in env.tool_defs or []
    ]


@functools.cache
def _loaded(spec: str, args_json: str) -> Any:
    vf = verifiers()
    args = json.loads(args_json)
    where = f"agent.verifiers={spec!r}"
    handlers = SavedSignalHandlers()
    try:
        if ":" in spec:
            env = import_callable(spec, "agent.verifiers")(**args)
        else:
            missing = missing_environment(spec)
            if missing is not None:
                raise VerifiersLoadError(missing)
            env = vf.load_environment(spec, **args)
    except VerifiersLoadError:
        raise
    except Exception as exc:  # the environment's own code (verifiers' loader wraps it: its cause is the error)
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        raise VerifiersLoadError(
            f"{where}: load_environment({_args(args)}) raised {type(cause).__name__}: {cause}"
        ) from exc
    finally:
        handlers.restore()
    if not isinstance(env, vf.Environment):
        raise VerifiersLoadError(
            f"{where}: load_environment returned {type(env).__name__}, not a verifiers Environment"
        )
    guard_rubric(env.rubric)
    return env


def environment_rows(env: Any, split: Literal["train", "eval"]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(source, row)`` pairs of the environment's dataset (``get_dataset``) or eval split
    (``get_eval_dataset``; none when it has none: verifiers would fall back to the training rows,
    which must never be held out), in the shape :func:`postrl.data.dataset.build_prompts` reads:
    the prompt's messages, and the whole row as the rollout's input."""
    if split == "eval" and env.eval_dataset is None and env.eval_dataset_source is None:
        return
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    name = env.env_id or type(env).__name__
    for i, row in enumerate(dataset):
        if not isinstance(row.get("prompt"), list):
            raise VerifiersLoadError(
                f"{name} {split} row {i}: its prompt is {type(row.get('prompt')).__name__}, not messages"
            )
        yield f"{name}:{split}[{i}]", {"messages": row["prompt"], ROW_COLUMN: row}


class SavedSignalHandlers:
    """The process's SIGINT and SIGTERM handlers, to put back: a verifiers Environment installs its
    own when it is made (a Ctrl-C would tear the environment down and raise at once, a SIGTERM exit
    with 143), which would take a run's stop-after-the-step away. verifiers' teardown still runs at
    exit (it registers it with atexit)."""

    def __init__(self) -> None:
        on_main = threading.current_thread() is threading.main_thread()
        self.saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}

    def restore(self) -> None:
        for number, handler in self.saved.items():
            signal.signal(number, handler)


def _args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


_failures: contextvars.ContextVar[list[str]] = contextvars.ContextVar("verifiers_rubric_failures")


def guard_rubric(rubric: Any) -> None:
    """Wrap each reward function of ``rubric`` (and of the rubrics of a RubricGroup) so that a
    failure is recorded for the group being scored (:data:`_failures`); the wrapper has the
    function's signature and name (verifiers picks a function's arguments, and tells group
    functions apart, by its signature) and returns its value unchanged. Idempotent."""
    vf = verifiers()
    if isinstance(rubric, vf.RubricGroup):
        for inner in rubric.rubrics:
            guard_rubric(inner)
        return
    rubric.funcs = [f if isinstance(f, _Guarded) else _Guarded(f) for f in rubric.funcs]


class _Guarded:
    """A reward function that records why it failed before failing as verifiers expects."""

    def __init__(self, func: Callable[..., Any]) -> None:
        functools.update_wrapper(self, func)
        self.func = func

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = self.func.__name__
        try:
            value = self.func(*args, **kwargs)
            if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
                value = await value
        except Exception as exc:
            _record(f"reward function {name} raised {type(exc).__name__}: {exc}")
            raise
        if not _numbers(value):
            _record(f"reward function {name} returned {type(value).__name__} {value!r:.60}, not a number")
        return value


def _numbers(value: Any) -> bool:
    """A reward function's value verifiers can use: a finite number, or (a group function's) a list of them."""
    values = value if isinstance(value, list) else [value]
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def _record(reason: str) -> None:
    failures = _failures.get(None)
    if failures is not None:
        failures.append(reason)


class GroupResult:
    """One prompt's group: each rollout's reward, rubric metrics and error (None: it went well)."""

    def __init__(self, states: list[Any], rubric_failures: list[str]) -> None:
        self.rewards = [state.get("reward") for state in states]
        self.metrics = [dict(state.get("metrics") or {}) for state in states]
        self.stop = [state.get("stop_condition") for state in states]
        rubric = RubricFunctionError(rubric_failures[0]) if rubric_failures else None
        self.errors: list[BaseException | None] = [_state_error(state) or rubric for state in states]


def _state_error(state: Any) -> BaseException | None:
    error = state.get("error")
    return error if isinstance(error, BaseException) else None


class VerifiersGroups:
    """The environment's rollouts of each prompt, ``n`` at a time, recorded token by token."""

    def __init__(self, endpoint: RecordingEndpoint, env: Any, workers: int = 8, timeout_s: float | None = None) -> None:
        """Takes over ``endpoint``: :meth:`close` closes it."""
        import openai  # noqa: F401 - imported once here, not inside the first groups' time limits

        (self.model,) = endpoint.recorders
        self.endpoint = endpoint
        self.recorder = endpoint.recorders[self.model]
        self.env = env
        self.workers = workers
        self.timeout_s = timeout_s

    def run(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """Every group's rollouts, in prompt order. A group that times out, whose rollout raised
        outside verifiers' own error handling, or whose rubric failed, is unscorable (env_error,
        with the reason); a rollout verifiers ended with an error is too. Nothing is dropped: a
        rollout that made no model call is one empty, failed rollout."""
        self.recorder.resume()
        jobs = [(i, p, [f"{uuid.uuid4().hex[:12]}-{i}-{k}" for k in range(sampling.n)]) for i, p in enumerate(prompts)]
        with phase("episodes", len(jobs) * sampling.n, "episodes") as shown:

            def group(prompt: Prompt, episodes: list[str]) -> GroupResult:
                try:
                    return asyncio.run(self._play(prompt, episodes, sampling))
                finally:
                    shown.advance(len(episodes), sum(self.recorder.generated_tokens(e) for e in episodes))

            calls = [lambda p=p, eps=eps: group(p, eps) for _, p, eps in jobs]
            outcomes = run_limited(calls, self.timeout_s, self.workers, "verifiers group")
        return [r for (i, _, eps), outcome in zip(jobs, outcomes) for r in self._rollouts(i, eps, outcome)]

    async def _play(self, prompt: Prompt, episodes: list[str], sampling: SamplingParams) -> GroupResult:
        """``Environment.run_group``'s steps (rollouts, then the group's scoring, then cleanup), each
        rollout on its own episode's client."""
        from openai import AsyncOpenAI

        vf = verifiers()
        row = prompt.columns[ROW_COLUMN]
        args = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}
        clients = [
            AsyncOpenAI(base_url=f"{self.endpoint.root}/episodes/{e}/v1", api_key="postrl", max_retries=0)
            for e in episodes
        ]
        try:
            states = await asyncio.gather(
                *(
                    self.env.rollout(deepcopy(row), vf.OpenAIChatCompletionsClient(c), self.model, dict(args))
                    for c in clients
                )
            )
            failures: list[str] = []
            _failures.set(failures)
            guard_rubric(self.env.rubric)  # again: a function the environment added since
            if self.env.score_rollouts:
                await self.env.rubric.score_group(states)
            else:
                await self.env.rubric.dummy_score_group(states)
            for state in states:
                await self.env.rubric.cleanup(state)
            return GroupResult(states, failures)
        finally:
            for c in clients:
                await c.close()

    def _rollouts(self, index: int, episodes: list[str], outcome: Outcome[GroupResult]) -> list[Rollout]:
        out = []
        for k, episode in enumerate(episodes):
            rec = self.recorder.take(episode) or RecordedEpisode()
            result = outcome.value
            error = outcome.error if result is None else result.errors[k]
            reward = None if result is None else result.rewards[k]
            stage = "rubric" if isinstance(error, RubricFunctionError) else "rollout"
            info = {} if error is None else failure_info(error, stage)
            if result is not None and result.stop[k] is not None:
                info["stop_condition"] = result.stop[k]
            if error is not None:
                rec.finish_reason = "env_error"
            if not any(any(s.mask) for s in rec.samples):
                if error is None:
                    info.update(failure_info(RuntimeError("the rollout made no model call"), "rollout"))
                rec.finish_reason = "env_error"
                out.append(failed_rollout(index, [], rec.episode(None, info, outcome.seconds)))
                continue
            rollouts = rec.rollouts(index, self.recorder.renderer, reward, outcome.seconds)
            for r in rollouts:
                assert r.episode is not None
                r.episode.info.update(info)
                r.episode.metrics = {} if result is None else result.metrics[k]
            out.extend(rollouts)
        return out

    def close(self) -> None:
        self.endpoint.close()
