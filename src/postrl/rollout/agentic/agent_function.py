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

With several policies (``policies:``) every call names its policy, by ``model`` on the episode's
base URL or by the policy's own base URL (``row["policy_urls"][NAME]``); each policy's turns are
recorded apart and become its own samples. The function returns one reward for every policy, or
a mapping ``{policy: reward}`` that names each policy that made a call.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from postrl.config.imports import import_callable
from postrl.rollout.agentic.limited import Outcome, failure_info, run_limited
from postrl.rollout.agentic.recorder import EpisodeRecorder, RecordedEpisode
from postrl.rollout.agentic.trajectory import failed_rollout
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.episode import Episode, RecordedCalls
from postrl.types.progress import Phase, phase

# (client, row) -> the episode's reward: one for every policy, by policy, or None (the service scores)
AgentFunction = Callable[[Any, dict[str, Any]], "float | dict[str, float] | None"]


def load_agent_function(spec: str) -> AgentFunction:
    return import_callable(spec, "agent.function")


# the info of an episode whose agent function returned without calling the model
NO_MODEL_CALL = {
    "env_error": "no model call",
    "env_reason": "the agent function made no model call",
    "env_failed_in": "agent",
}


class RecordingEndpoint(Protocol):
    """An OpenAI-compatible server over the run's engines that records each episode's calls, apart
    for each policy."""

    @property
    def root(self) -> str:
        """Its address, ``http://127.0.0.1:PORT``."""
        ...

    @property
    def recorders(self) -> dict[str, EpisodeRecorder]:
        """Each policy's recorder, by the name its calls use."""
        ...

    def policy_root(self, name: str) -> str:
        """The address at which every call reaches policy ``name``."""
        ...

    def close(self) -> None: ...


Reward = float | None
PolicyRollouts = dict[str, list[Rollout]]  # an episode's (or a batch's) rollouts, by policy


class RecordedAgents:
    """The user's agent function, run ``n`` times per prompt against a recording endpoint."""

    def __init__(
        self,
        endpoint: RecordingEndpoint,
        function: AgentFunction,
        workers: int = 8,
        timeout_s: float | None = None,
    ) -> None:
        """Takes over ``endpoint``: :meth:`close` closes it."""
        import openai  # noqa: F401 - imported once here, not inside the first episodes' time limits

        self.endpoint = endpoint
        self.recorders = endpoint.recorders
        self.function = function
        self.workers = workers
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._suspending = False
        self._returned: set[str] = set()  # episodes whose function returned before a suspend

    def episode_url(self, episode: str) -> str:
        """The OpenAI base URL that records into ``episode``."""
        return f"{self.endpoint.root}/episodes/{episode}/v1"

    @property
    def policies(self) -> list[str]:
        """The policies whose calls it records, by name."""
        return list(self.recorders)

    @property
    def several(self) -> bool:
        """Whether the episodes' calls go to several policies (then the function names one per call)."""
        return len(self.recorders) > 1

    def run(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """Every episode's rollouts, in prompt order. A function that raises, returns something other
        than a number or None, passes ``timeout_s`` or returns without calling the model fails its
        episode (env_error, unscorable: counted against ``reward.max_failure_rate``, which stops a
        run whose function never calls the model, naming the reason), never the batch; such an
        episode with no model call is one empty rollout. After :meth:`suspend`, every episode whose
        function had not returned is one ``suspended`` rollout carrying its recorded calls."""
        (name,) = self.recorders
        return self.run_policies(prompts, sampling)[name]

    def run_policies(self, prompts: list[Prompt], sampling: SamplingParams) -> PolicyRollouts:
        """:meth:`run` for every policy: each policy's rollouts, in prompt order. An episode in which a
        policy made no call gives it no rollout; one in which no policy did fails for each of them."""
        jobs = [(i, p, f"{uuid.uuid4().hex[:12]}-{i}-{k}") for i, p in enumerate(prompts) for k in range(sampling.n)]
        episodes = self._run(jobs)
        return {name: [r for ep in episodes for r in ep[name]] for name in self.recorders}

    def rerun(self, prompts: list[Prompt], rollouts: list[Rollout]) -> list[Rollout]:
        """A batch a checkpoint suspended: each suspended episode's function runs again from its
        start under its own episode id, its model calls answered from its recorded ones while its
        prompts are exactly theirs (``RecordedCalls``), so its trajectory is the one it was making;
        the finished episodes are kept. In the batch's order."""
        (name,) = self.recorders  # a run with several policies is sync: nothing is suspended
        recorder = self.recorders[name]
        jobs, slots = [], []
        for at, r in enumerate(rollouts):
            calls = r.episode.calls if r.episode is not None and r.finish_reason == "suspended" else None
            if calls is not None:
                recorder.replay(calls)
                jobs.append((r.prompt_index, prompts[r.prompt_index], calls.episode_id))
                slots.append(at)
        again = dict(zip(slots, (ep[name] for ep in self._run(jobs)), strict=True))
        return [x for at, r in enumerate(rollouts) for x in again.get(at, [r])]

    def suspend(self) -> bool:
        """A checkpoint: model calls are refused from now on (an agent's call fails, so its function
        ends soon), and every episode whose function has not returned comes back ``suspended``
        (:meth:`rerun` continues it). True when episodes were running."""
        with self._lock:
            self._suspending = True
        for recorder in self.recorders.values():
            recorder.suspend()
        return True

    def _run(self, jobs: list[tuple[int, Prompt, str]]) -> list[PolicyRollouts]:
        with self._lock:
            self._suspending = False
        for recorder in self.recorders.values():
            recorder.resume()
        with phase("episodes", len(jobs), "episodes") as shown:
            calls = [lambda job=job: self._counted(shown, job[1], job[2]) for job in jobs]
            outcomes = run_limited(calls, self.timeout_s, self.workers, "agent function")
        done = [self._episode(index, episode, outcome) for (index, _, episode), outcome in zip(jobs, outcomes)]
        with self._lock:
            self._returned.difference_update(episode for _, _, episode in jobs)
        return done

    def _counted(self, shown: Phase, prompt: Prompt, episode: str) -> Reward | dict[str, Reward]:
        """:meth:`_call`, the episode counted in ``shown`` with the tokens its policies generated."""
        try:
            return self._call(prompt, episode)
        finally:
            shown.advance(1, sum(rec.generated_tokens(episode) for rec in self.recorders.values()))

    def _call(self, prompt: Prompt, episode: str) -> Reward | dict[str, Reward]:
        import openai

        if self._suspending:
            raise RuntimeError("suspended before it started")
        client = openai.OpenAI(base_url=self.episode_url(episode), api_key="postrl", max_retries=0)
        row = {**prompt.columns, "prompt": prompt.question, "messages": prompt.messages}
        if self.several:
            row["policy_urls"] = {
                name: f"{self.endpoint.policy_root(name)}/episodes/{episode}/v1" for name in self.recorders
            }
        try:
            reward = self.function(client, row)
        finally:
            client.close()
            with self._lock:
                if not self._suspending:
                    self._returned.add(episode)
        if self.several and isinstance(reward, dict):
            unknown = sorted(set(reward) - set(self.recorders))
            if unknown:
                raise TypeError(
                    f"the agent function's rewards name {unknown}, not policies of this run {list(self.recorders)}"
                )
            return {name: checked_reward(value) for name, value in reward.items()}
        return checked_reward(reward)

    def _episode(self, index: int, episode: str, outcome: Outcome[Reward | dict[str, Reward]]) -> PolicyRollouts:
        """The episode's rollouts of each policy. One that failed before any policy's first call is
        one failed rollout for each policy (every policy counts the failure)."""
        with self._lock:
            suspended = self._suspending and episode not in self._returned
        if suspended:
            return {name: [suspended_rollout(index, rec.saved_calls(episode))] for name, rec in self.recorders.items()}
        recorded = {name: rec.take(episode) or RecordedEpisode() for name, rec in self.recorders.items()}
        acted = [name for name, rec in recorded.items() if any(any(s.mask) for s in rec.samples)]
        error, rewards = outcome.error, outcome.value
        if error is None and isinstance(rewards, dict) and (missing := [n for n in acted if n not in rewards]):
            error = TypeError(f"the agent function's rewards leave out {missing}, which made model calls")
        out: PolicyRollouts = {}
        for name, rec in recorded.items():
            if error is not None:
                rec.finish_reason = "env_error"
            reward = rewards.get(name) if isinstance(rewards, dict) else rewards
            rollouts = rec.rollouts(index, self.recorders[name].renderer, reward, outcome.seconds)
            if not acted:  # nothing to train on, and no reward to trust
                info = NO_MODEL_CALL if error is None else failure_info(error, "agent")
                rec.finish_reason = "env_error"
                rollouts = [failed_rollout(index, [], rec.episode(None, info, outcome.seconds))]
            elif error is not None:
                for r in rollouts:
                    assert r.episode is not None
                    r.episode.info.update(failure_info(error, "agent"))
            out[name] = rollouts
        return out

    def close(self) -> None:
        self.endpoint.close()


def checked_reward(reward: object) -> Reward:
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise TypeError(f"the agent function returned {type(reward).__name__} {reward!r:.40}, not a number or None")
    return None if reward is None else float(reward)


def suspended_rollout(index: int, calls: RecordedCalls) -> Rollout:
    """An episode a checkpoint stopped: its recorded calls, to run it again (:meth:`RecordedAgents.rerun`)."""
    return Rollout(index, [], [], [], "", "suspended", 0, episode=Episode([], [], None, "suspended", calls=calls))
