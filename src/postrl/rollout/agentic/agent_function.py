"""``agent.function``: train an agent written against the OpenAI API.

The run serves its rollout engine on loopback through an OpenAI-compatible server that records
every episode (:mod:`postrl.rollout.agentic.recorder`; the server is
:class:`postrl.serve.recording_server.RecordingServer`, handed in as a
:class:`RecordingEndpoint`). For each prompt it runs the user's
``function(client, row) -> reward`` ``n`` times in threads, each with an ``openai.OpenAI`` client
whose base URL is the episode's own (``http://127.0.0.1:PORT/episodes/ID/v1``): an agent
framework pointed at ``str(client.base_url)`` records into the episode with no other change, on
chat completions, the Responses API or (at the URL without ``/v1``) the Messages API. The
recorded, token-exact trajectories are the batch. The function's return value is the episode's
reward (None: the reward service scores the transcript). The row is the prompt's columns with
``prompt`` (the question: ``Prompt.question``) and ``messages``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from postrl.config.imports import import_callable
from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.episodes import failed_rollout
from postrl.rollout.agentic.limited import Outcome, failure_info, run_limited
from postrl.rollout.agentic.recorder import EpisodeRecorder, RecordedEpisode
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.episode import Episode

AgentFunction = Callable[[Any, dict[str, Any]], "float | None"]


def load_agent_function(spec: str) -> AgentFunction:
    return import_callable(spec, "agent.function")


# the info of an episode whose agent function returned without calling the model
NO_MODEL_CALL = {
    "env_error": "no model call",
    "env_reason": "the agent function made no model call",
    "env_failed_in": "agent",
}


class RecordingEndpoint(Protocol):
    """An OpenAI-compatible server over the run's engine that records each episode's calls."""

    @property
    def root(self) -> str:
        """Its address, ``http://127.0.0.1:PORT``."""
        ...

    @property
    def recorder(self) -> EpisodeRecorder: ...

    def close(self) -> None: ...


class RecordedAgents:
    """The user's agent function, run ``n`` times per prompt against a recording endpoint."""

    def __init__(
        self,
        endpoint: RecordingEndpoint,
        tokenizer: Any,
        function: AgentFunction,
        workers: int = 8,
        timeout_s: float | None = None,
    ) -> None:
        """Takes over ``endpoint``: :meth:`close` closes it."""
        import openai  # noqa: F401 - imported once here, not inside the first episodes' time limits

        self.endpoint = endpoint
        self.function = function
        self.workers = workers
        self.timeout_s = timeout_s
        self.renderer = ChatRenderer(tokenizer)
        self._lock = threading.Lock()
        self._suspending = False
        self._returned: set[str] = set()  # episodes whose function returned before a suspend

    def episode_url(self, episode: str) -> str:
        """The OpenAI base URL that records into ``episode``."""
        return f"{self.endpoint.root}/episodes/{episode}/v1"

    def run(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """Every episode's rollouts, in prompt order. A function that raises, returns something other
        than a number or None, passes ``timeout_s`` or returns without calling the model fails its
        episode (env_error, unscorable: counted against ``reward.max_failure_rate``, which stops a
        run whose function never calls the model, naming the reason), never the batch; such an
        episode with no model call is one empty rollout. After :meth:`suspend`, every episode whose
        function had not returned is one ``suspended`` rollout carrying its recorded calls."""
        jobs = [(i, p, f"{uuid.uuid4().hex[:12]}-{i}-{k}") for i, p in enumerate(prompts) for k in range(sampling.n)]
        return [r for rollouts in self._run(jobs) for r in rollouts]

    def rerun(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[Rollout]:
        """A batch a checkpoint suspended: each suspended episode's function runs again from its
        start under its own episode id, its model calls answered from its recorded ones while its
        prompts are exactly theirs (``RecordedCalls``), so its trajectory is the one it was making;
        the finished episodes are kept. In the batch's order."""
        jobs, slots = [], []
        for at, r in enumerate(rollouts):
            calls = r.episode.calls if r.episode is not None and r.finish_reason == "suspended" else None
            if calls is not None:
                self.endpoint.recorder.replay(calls)
                jobs.append((r.prompt_index, prompts[r.prompt_index], calls.episode_id))
                slots.append(at)
        again = dict(zip(slots, self._run(jobs), strict=True))
        return [x for at, r in enumerate(rollouts) for x in again.get(at, [r])]

    def suspend(self) -> bool:
        """A checkpoint: model calls are refused from now on (an agent's call fails, so its function
        ends soon), and every episode whose function has not returned comes back ``suspended``
        (:meth:`rerun` continues it). True when episodes were running."""
        with self._lock:
            self._suspending = True
        self.endpoint.recorder.suspend()
        return True

    def _run(self, jobs: list[tuple[int, Prompt, str]]) -> list[list[Rollout]]:
        with self._lock:
            self._suspending = False
        self.endpoint.recorder.resume()
        calls = [lambda job=job: self._call(job[1], job[2]) for job in jobs]
        outcomes = run_limited(calls, self.timeout_s, self.workers, "agent function")
        done = [self._episode(index, episode, outcome) for (index, _, episode), outcome in zip(jobs, outcomes)]
        with self._lock:
            self._returned.difference_update(episode for _, _, episode in jobs)
        return done

    def _call(self, prompt: Prompt, episode: str) -> float | None:
        import openai

        if self._suspending:
            raise RuntimeError("suspended before it started")
        client = openai.OpenAI(base_url=self.episode_url(episode), api_key="postrl", max_retries=0)
        row = {**prompt.columns, "prompt": prompt.question, "messages": prompt.messages}
        try:
            reward = self.function(client, row)
        finally:
            client.close()
            with self._lock:
                if not self._suspending:
                    self._returned.add(episode)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise TypeError(f"the agent function returned {type(reward).__name__} {reward!r:.40}, not a number or None")
        return None if reward is None else float(reward)

    def _episode(self, index: int, episode: str, outcome: Outcome[float | None]) -> list[Rollout]:
        with self._lock:
            suspended = self._suspending and episode not in self._returned
        if suspended:
            calls = self.endpoint.recorder.saved_calls(episode)
            return [
                Rollout(index, [], [], [], "", "suspended", 0, episode=Episode([], [], None, "suspended", calls=calls))
            ]
        recorded = self.endpoint.recorder.take(episode) or RecordedEpisode()
        if outcome.error is not None:
            recorded.finish_reason = "env_error"
        rollouts = recorded.rollouts(index, self.renderer, outcome.value, outcome.seconds)
        if outcome.error is None and not rollouts:  # nothing to train on, and no reward to trust
            recorded.finish_reason = "env_error"
            return [failed_rollout(index, [], recorded.episode(None, NO_MODEL_CALL, outcome.seconds))]
        if outcome.error is None:
            return rollouts
        info = failure_info(outcome.error, "agent")
        if not rollouts:
            return [failed_rollout(index, [], recorded.episode(None, info, outcome.seconds))]
        for r in rollouts:
            assert r.episode is not None
            r.episode.info.update(info)
        return rollouts

    def close(self) -> None:
        self.endpoint.close()
