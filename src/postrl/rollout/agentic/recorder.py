"""Token-exact trajectories of agents that speak the OpenAI API (``postrl serve-rollout --record``).

An agent sends the whole conversation with every chat request; the server must not re-tokenize
what the model already generated. For a request of a recorded episode the recorder renders the
conversation, checks that the text the engine saw last time (the previous prompt plus the decoded
response) is a prefix of it, and builds the prompt as the previous context's exact tokens plus
the delta's; where the agent rewrote the history, a new training sample starts from the
template's rendering (the break is counted). The engine then generates from those ids, and the
recorder appends its tokens, logprobs and weight versions."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.episodes import TrajectorySample, sample_rollout
from postrl.types import Rollout
from postrl.types.episode import Episode, Turn


@dataclass
class RecordedEpisode:
    samples: list[TrajectorySample] = field(default_factory=list)
    seen: str | None = None  # the template text of the last sample's context
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    prefix_breaks: int = 0
    finish_reason: str = "stop"

    def rollouts(self, prompt_index: int, renderer: ChatRenderer, reward: float | None) -> list[Rollout]:
        kept = [s for s in self.samples if any(s.mask)]
        episode = self.episode(reward)
        return [sample_rollout(prompt_index, s, episode, part, renderer) for part, s in enumerate(kept)]

    def episode(self, reward: float | None, info: dict[str, Any] | None = None) -> Episode:
        kept = sum(any(s.mask) for s in self.samples)
        dropped = {"no_model_tokens": len(self.samples) - kept} if len(self.samples) > kept else {}
        return Episode(
            self.messages, self.turns, reward, self.finish_reason, dict(info or {}), self.prefix_breaks, dropped
        )


class EpisodeRecorder:
    """Every recorded episode by id, until it is taken."""

    def __init__(self, tokenizer: Any, max_episodes: int = 100_000) -> None:
        self.renderer = ChatRenderer(tokenizer)
        self.max_episodes = max_episodes
        self.episodes: dict[str, RecordedEpisode] = {}
        self._lock = threading.Lock()

    def prompt(self, episode_id: str, messages: list[dict[str, Any]]) -> list[int]:
        """The exact prompt ids of this request of the episode (see the module docstring)."""
        with self._lock:
            if episode_id not in self.episodes and len(self.episodes) >= self.max_episodes:
                raise ValueError(f"{self.max_episodes} episodes are recorded and not taken yet")
            ep = self.episodes.setdefault(episode_id, RecordedEpisode())
        full = self.renderer.render(messages, generation_prompt=True)
        if ep.seen is not None and full.startswith(ep.seen):
            delta = self.renderer.encode(full[len(ep.seen) :])
            sample = ep.samples[-1]
            n = len(delta)
            sample.add(delta, [0.0] * n, [sample.versions[-1]] * n, [sample.cache_versions[-1]] * n, generated=False)
            if ep.turns:
                ep.turns[-1].observation_tokens = n
        else:
            ep.prefix_breaks += ep.seen is not None
            ep.samples.append(TrajectorySample(self.renderer.encode(full)))
        ep.seen, ep.messages = full, list(messages)
        return ep.samples[-1].context

    def record(self, episode_id: str, rollout: Rollout) -> None:
        """The engine's response to the episode's last prompt."""
        ep = self.episodes[episode_id]
        sample = ep.samples[-1]
        if rollout.prompt_ids != sample.context:
            raise ValueError(f"episode {episode_id}: the engine answered another prompt than the recorded one")
        own = rollout.logprob_versions or [rollout.weight_version] * len(rollout.response_ids)
        ep.turns.append(Turn(len(sample.context), len(rollout.response_ids)))
        sample.add(rollout.response_ids, rollout.logprobs, own, rollout.kv_versions or own, generated=True)
        _, seen = self.renderer.model_turn(rollout.response_ids, stopped=rollout.finish_reason == "stop")
        ep.seen = (ep.seen or "") + seen
        ep.finish_reason = rollout.finish_reason

    def take(self, episode_id: str) -> RecordedEpisode | None:
        with self._lock:
            return self.episodes.pop(episode_id, None)

    def view(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's samples as JSON (``GET /v1/episodes/{id}``)."""
        ep = self.episodes.get(episode_id)
        if ep is None:
            return None
        samples = [
            {"prompt_ids": s.prompt_ids, "response_ids": s.response, "logprobs": s.logprobs, "loss_mask": s.mask,
             "versions": s.versions}
            for s in ep.samples
        ]  # fmt: skip
        return {"episode_id": episode_id, "samples": samples, "turns": len(ep.turns), "prefix_breaks": ep.prefix_breaks}
