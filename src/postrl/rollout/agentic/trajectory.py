"""One actor's token-exact trajectory through an episode: its model turns appended as the engine
returned them, the template's delta for what it is shown next, its training samples at the end.

A one-actor episode (:class:`~.episodes.EpisodeRunner`) has one such trajectory; a seated game
(:class:`~.seated_games.SeatedGames`) one per seat. Both keep it on a
:class:`~.episode_ops.LiveEpisode` and change it only through these functions, so a seat's
samples are made exactly as an environment episode's are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.episode_ops import EpisodeLimits, LiveEpisode
from postrl.types import Rollout, compact_versions
from postrl.types.episode import Episode, TrajectorySample, Turn

PrefixPolicy = Literal["split", "keep_context"]


class TrajectoryError(RuntimeError):
    """The engine was given or returned tokens other than the trajectory's: never trained on."""


def check_trajectory(e: LiveEpisode, r: Rollout) -> None:
    if r.prompt_ids != e.sample.context:
        raise TrajectoryError(f"{e.key}: the engine generated from other tokens than the trajectory's")


def record_turn(e: LiveEpisode, r: Rollout, limits: EpisodeLimits) -> None:
    """The engine's turn checked against the trajectory and appended to it; ``e.finish`` says what
    follows: ``pending`` (its environment decides), or the limit the turn reached."""
    check_trajectory(e, r)
    own = r.logprob_versions or [r.weight_version] * len(r.response_ids)
    cache = r.kv_versions or own
    e.turns.append(Turn(len(e.sample.context), len(r.response_ids)))
    e.sample.add(r.response_ids, r.logprobs, own, cache, generated=True)
    content, seen = e.renderer.model_turn(r.response_ids, stopped=r.finish_reason == "stop")
    e.seen += seen
    e.contents.append(content)
    if r.finish_reason == "length" and len(r.response_ids) < limits.max_tokens_per_turn:
        e.finish = "max_context"
    elif r.finish_reason == "length" and limits.end_on_turn_length:
        e.finish = "length"
    elif r.finish_reason == "suspended":
        e.finish = "suspended"
    else:
        e.finish = "pending"


def continue_context(e: LiveEpisode, added: list[dict[str, Any]], on_prefix_break: PrefixPolicy) -> None:
    """The context of ``e``'s next turn: ``e.messages`` (which ends with ``added``) rendered as the
    template's delta after what the engine has seen. Where the template rewrote the history the
    break is counted and, with ``split`` (or where even the appended rendering breaks), a new
    training sample starts from the template's rendering; nothing is re-tokenized into a sample."""
    delta, full = e.renderer.delta(e.seen, e.messages)
    if not delta.ok and on_prefix_break == "keep_context":
        e.breaks += 1
        delta = e.renderer.appended_delta(added)
        full = e.seen + (delta.text or "")
    elif not delta.ok:
        e.breaks += 1
    if not delta.ok:
        e.done_samples.append(e.sample)
        e.sample, e.seen = TrajectorySample(e.renderer.encode(full)), full
        return
    assert delta.ids is not None
    n = len(delta.ids)
    e.sample.add(delta.ids, [0.0] * n, [e.sample.versions[-1]] * n, [e.sample.cache_versions[-1]] * n, False)
    e.seen = full
    e.turns[-1].observation_tokens = n


def episode_rollouts(e: LiveEpisode, seat: str | None = None) -> list[Rollout]:
    """The trajectory's training samples (``seat``: the seated game's seat it plays); one that
    failed before the model wrote anything is one empty rollout, so its failure is counted and
    saved like any other."""
    every = [*e.done_samples, e.sample]
    samples = [s for s in every if any(s.mask)]
    episode = Episode(
        messages=e.messages,
        turns=e.turns,
        reward=sum(e.rewards) if e.rewards else None,
        finish_reason=e.finish or "stop",
        info=e.info,
        prefix_breaks=e.breaks,
        dropped={"no_model_tokens": len(every) - len(samples)} if len(every) > len(samples) else {},
        env_s=e.env_s,
        generate_s=e.generate_s,
        seat=seat,
    )
    if not samples and e.finish == "env_error":
        return [failed_rollout(e.prompt_index, e.sample.prompt_ids, episode)]
    return [sample_rollout(e.prompt_index, s, episode, part, e.renderer) for part, s in enumerate(samples)]


def failed_rollout(prompt_index: int, prompt_ids: list[int], episode: Episode) -> Rollout:
    """An episode that failed before the model's first token: no tokens to train on, but a row that
    carries its failure to the reward, the failure rate and the samples file."""
    return Rollout(prompt_index, list(prompt_ids), [], [], "", "env_error", 0, episode=episode)


def sample_rollout(
    prompt_index: int, s: TrajectorySample, episode: Episode, part: int, renderer: ChatRenderer
) -> Rollout:
    """A training sample as a Rollout: observation tokens after its last model turn are dropped
    (they would train nothing)."""
    end = max(i for i, m in enumerate(s.mask) if m) + 1
    own, cache = s.versions[:end], s.cache_versions[:end]
    oldest, versions, kv = compact_versions(own, cache, min(own))
    return Rollout(
        prompt_index=prompt_index,
        prompt_ids=s.prompt_ids,
        response_ids=s.response[:end],
        logprobs=s.logprobs[:end],
        text=renderer.decode(s.response[:end]),
        finish_reason=episode.finish_reason,  # type: ignore[arg-type]
        weight_version=oldest,
        logprob_versions=versions,
        kv_versions=kv,
        loss_mask=s.mask[:end],
        episode=replace(episode, part=part),
    )
