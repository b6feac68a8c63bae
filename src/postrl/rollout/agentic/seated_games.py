"""Seated games (``agent.seats``) played inside the episode machinery, at token level.

A seated environment (:mod:`.seats`) says after every turn which seat acts next and what each
seat is shown. :class:`SeatedGames` is the :class:`~.episode_ops.EpisodeOps` of such games: each
seat keeps its own token-exact trajectory (a :class:`~.episode_ops.LiveEpisode` changed only by
:mod:`.trajectory`, as an environment episode's is), and the acting seat's turn is generated on the
engine of the policy that plays it, from the game's random stream (turn ``t`` of a game samples
from ``derive(stream, t)``), with no HTTP and no re-rendered chat. So either schedule
(:class:`~.lockstep.Lockstep`, :class:`~.individual.Individual`) plays them, ``env_timeout_s``
bounds each reset and step, ``max_context`` each seat's context, and a seed gives the same games at
any ``env_workers``.

A game's samples are each seat's that acted (a seat that never acted has none), tagged with the
seat (``Episode.seat``) and handed to the seat's policy; a seat's reward is the sum of the rewards
the environment gave it. A game that ended before any seat acted (a failed reset, say) is one
failed rollout for every seat, so every policy counts the failure. Training batches sample at each
policy's own temperature, top_p and top_k; held-out games (a greedy sampling) are greedy for every
seat.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.checks import EnvironmentOutputError
from postrl.rollout.agentic.episode_ops import EpisodeLimits, EpisodeSchedule, Job, LiveEpisode
from postrl.rollout.agentic.episodes import episode_jobs
from postrl.rollout.agentic.limited import Outcome, failure_info, run_limited
from postrl.rollout.agentic.seats import SeatedEnvironment, SeatStep, check_seat_step, seats_of
from postrl.rollout.agentic.trajectory import (
    PrefixPolicy,
    continue_context,
    episode_rollouts,
    record_turn,
)
from postrl.rollout.streams import derive
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.types.episode import EpisodeState, TrajectorySample
from postrl.workers.roles import RolloutWorker

PolicyRollouts = dict[str, list[Rollout]]  # a batch's rollouts, by policy
_keys = itertools.count()


@dataclass(frozen=True)
class SeatPlayer:
    """A policy that plays a seat: its engine and tokenizer, and how its turns sample (its rollout
    section's temperature, top_p, top_k and stops; how many tokens a turn may have is the game's)."""

    engine: RolloutWorker
    tokenizer: Any
    sampling: SamplingParams

    def turn(self, sampling: SamplingParams, end_of_turn: list[int]) -> SamplingParams:
        """One turn of this policy: ``sampling``'s length (greedy when ``sampling`` is), this
        policy's own randomness and stops, and ``end_of_turn`` (its template's)."""
        own = self.sampling
        stops = tuple(sorted(set(own.stop_token_ids) | set(end_of_turn)))
        turn = replace(own, n=1, max_tokens=sampling.max_tokens, stop=(*own.stop, "</tool_call>"), stop_token_ids=stops)
        return replace(turn, temperature=0.0) if sampling.temperature == 0 else turn


@dataclass
class SeatedGame:
    """A game in progress: each seat's trajectory, who acts, and how it is going."""

    prompt_index: int
    key: str
    env: SeatedEnvironment | None  # None when making it failed
    seats: dict[str, LiveEpisode]  # each seat's own trajectory, in the environment's seat order
    stream: int | None = None
    acting: str | None = None
    unseen: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # messages since a seat's last turn
    played: int = 0  # model turns so far, every seat's
    finish: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    env_s: float = 0.0
    generate_s: float = 0.0

    @property
    def turn(self) -> LiveEpisode:
        """The acting seat's trajectory."""
        assert self.acting is not None
        return self.seats[self.acting]


class SeatedGames:
    """Runs ``n`` games per prompt with ``seating`` (seat -> policy), each policy's turns on its
    :class:`SeatPlayer`; the :class:`~.episode_ops.EpisodeOps` its schedule drives."""

    def __init__(
        self,
        make_env: Callable[..., Any],
        env_options: dict[str, Any],
        env_name: str,
        seating: dict[str, str],
        players: dict[str, SeatPlayer],
        limits: EpisodeLimits,
        schedule: EpisodeSchedule,
        on_prefix_break: PrefixPolicy = "split",
    ) -> None:
        self.make_env = make_env
        self.env_options = env_options
        self.env_name = env_name
        self.seating = seating
        self.players = players
        self._limits = limits
        self.schedule = schedule
        self.on_prefix_break = on_prefix_break
        self.end_of_turn = {name: ChatRenderer(p.tokenizer).end_of_turn_ids() for name, p in players.items()}

    @property
    def policies(self) -> list[str]:
        return list(self.players)

    @property
    def limits(self) -> EpisodeLimits:
        return self._limits

    def run_policies(self, prompts: list[Prompt], sampling: SamplingParams) -> PolicyRollouts:
        """``sampling.n`` games of each prompt; each policy's rollouts (its seat's samples), in
        prompt order."""
        rollouts = self.schedule.run(self, episode_jobs(prompts, sampling.n), replace(sampling, n=1))
        out: PolicyRollouts = {name: [] for name in self.players}
        for r in rollouts:
            assert r.episode is not None and r.episode.seat is not None
            out[self.seating[r.episode.seat]].append(r)
        return out

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """Each prompt's turn on the engine of the policy it names, at that policy's sampling."""
        by_policy: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            assert p.policy is not None, "a seated game's turn names its policy"
            by_policy.setdefault(p.policy, []).append(i)
        out: list[Rollout | None] = [None] * len(prompts)
        for name, at in by_policy.items():
            player = self.players[name]
            turn = player.turn(sampling, self.end_of_turn[name])
            for i, r in zip(at, player.engine.generate([prompts[i] for i in at], turn, None), strict=True):
                out[i] = r
        return [r for r in out if r is not None]

    def reset_env(self, prompt: Prompt) -> tuple[SeatedEnvironment, SeatStep | Exception]:
        """A new game and what its reset shows the seats, or why the reset (or the seating) failed."""
        env = self.make_env(**self.env_options)
        row = {**prompt.columns, "prompt": prompt.question, "messages": prompt.messages}
        try:
            seats = seats_of(env, self.seating, self.env_name)
            return env, check_seat_step(env.reset(row), seats, "reset()")
        except Exception as exc:
            return env, exc

    def start(self, job: Job, outcome: Outcome[Any]) -> SeatedGame:
        index, prompt = job
        env, first = outcome.value if outcome.value is not None else (None, outcome.error)
        key = f"game-{next(_keys)}"
        seats = {seat: self._seat(index, f"{key}/{seat}", policy) for seat, policy in self.seating.items()}
        game = SeatedGame(index, key, env, seats, stream=prompt.stream)
        if not isinstance(first, SeatStep):
            assert isinstance(first, BaseException)
            game.finish = "env_error"
            game.info.update(failure_info(first, "reset"))
            return game
        self._show(game, first)
        return game

    def _seat(self, index: int, key: str, policy: str) -> LiveEpisode:
        renderer = ChatRenderer(self.players[policy].tokenizer)
        return LiveEpisode(index, key, None, renderer, [], "", TrajectorySample([]))

    def _show(self, game: SeatedGame, step: SeatStep) -> None:
        """A reset's or a step's result given to the seats; the next seat's context made ready, or
        the game over."""
        for seat, messages in step.messages.items():
            game.seats[seat].messages += messages
            game.unseen.setdefault(seat, []).extend(messages)
        for seat, reward in step.rewards.items():
            game.seats[seat].rewards.append(float(reward))
        game.info.update(step.info)
        if step.done or step.next_seat is None:
            game.finish = "stop"
        elif game.played >= self.limits.max_turns:
            game.finish = "max_turns"
        else:
            game.acting, game.finish = step.next_seat, None
            self._ready(game)

    def _ready(self, game: SeatedGame) -> None:
        """The acting seat's context for its turn: its whole conversation at its first turn, else the
        template's delta for what it was shown since its last."""
        seat = game.turn
        added = game.unseen.pop(game.acting or "", [])
        if not seat.messages:
            game.finish = "env_error"
            error = EnvironmentOutputError(f"seat {game.acting!r} is to act but has been shown no message")
            game.info.update(failure_info(error, "step"))
        elif not seat.seen:
            seat.seen = seat.renderer.render(seat.messages, generation_prompt=True)
            seat.sample = TrajectorySample(seat.renderer.encode(seat.seen))
        else:
            continue_context(seat, added, self.on_prefix_break)

    def budget(self, game: SeatedGame) -> int:
        """New tokens the acting seat's turn may have; 0: its context is full (the game ends, max_context)."""
        budget = min(self.limits.max_tokens_per_turn, self.limits.max_context - len(game.turn.sample.context))
        if budget <= 0:
            game.finish = "max_context"
        return max(budget, 0)

    def turn_prompt(self, game: SeatedGame) -> Prompt:
        seat = game.turn
        stream = None if game.stream is None else derive(game.stream, game.played)
        assert game.acting is not None
        policy = self.seating[game.acting]
        return Prompt(seat.seen, seat.sample.context, cache_key=seat.key, stream=stream, policy=policy)

    def record_generation(self, game: SeatedGame, r: Rollout) -> None:
        seat = game.turn
        record_turn(seat, r, self.limits)
        game.played += 1
        game.finish = seat.finish

    def step_env(self, game: SeatedGame) -> SeatStep:
        """The game answering the acting seat's turn, checked."""
        assert game.env is not None and game.acting is not None
        seats = tuple(self.seating)
        return check_seat_step(game.env.step(game.acting, game.turn.contents[-1]), seats, f"step({game.acting!r})")

    def observe(self, game: SeatedGame, outcome: Outcome[SeatStep]) -> None:
        """The game's answer to the acting seat's turn; a failure, a time-out or a malformed answer
        ends it (env_error: unscorable, the reason in ``info``)."""
        if outcome.error is not None:
            game.finish = "env_error"
            game.info.update(failure_info(outcome.error, "step"))
            return
        result, seat = outcome.value, game.turn
        assert result is not None and game.acting is not None
        seat.turns[-1].reward = result.rewards.get(game.acting)
        seat.messages.append({"role": "assistant", "content": seat.contents[-1]})
        self._show(game, result)

    def rollouts(self, game: SeatedGame) -> list[Rollout]:
        """Each seat's samples that acted, in seat order; one failed rollout per seat for a game in
        which no seat acted."""
        out = []
        for name, seat in game.seats.items():
            seat.finish, seat.info, seat.env_s, seat.generate_s = (
                game.finish,
                dict(game.info),
                game.env_s,
                game.generate_s,
            )
            if seat.turns:
                out += episode_rollouts(seat, name)
        if out:
            return out
        if game.finish != "env_error":
            why = f"the game ended ({game.finish}) before any seat's turn"
            game.info.update({"env_error": "no seat acted", "env_reason": why, "env_failed_in": "reset"})
        failed = []
        for name, seat in game.seats.items():
            seat.finish, seat.info = "env_error", dict(game.info)
            (r,) = episode_rollouts(seat, name)
            failed.append(r)
        return failed

    def suspended(self, game: SeatedGame) -> Rollout | None:
        """None: a run of several policies is sync, so its games are never suspended; they run on."""
        return None

    def restore_env(self, state: EpisodeState) -> SeatedEnvironment:
        raise TypeError("seated games are never suspended, so none is restored")

    def restored(self, prompt_index: int, state: EpisodeState, env: SeatedEnvironment) -> SeatedGame:
        raise TypeError("seated games are never suspended, so none is restored")

    def close_envs(self, envs: list[SeatedEnvironment], timeout_s: float | None = None) -> list[str]:
        """Every game's environment closed, within the time limit; why each close that failed did."""
        limit = self.limits.env_timeout_s if timeout_s is None else timeout_s
        outcomes = run_limited([env.close for env in envs], limit, self.limits.env_workers, "environment close")
        return [failure_info(o.error, "close")["env_error"] for o in outcomes if o.error is not None]

    def close(self) -> None:
        """Nothing to free: the engines are their policies', the games are closed as they end."""
