"""Environments in which several policies take turns: each seat played by a policy of the run.

A seated environment (two players of a game, a proposer and a solver, a debater and a judge) says
after every turn which seat acts next and what each seat now sees. ``agent.env`` names it and
``agent.seats`` maps its seats to the run's ``policies``; :mod:`.seated_games` plays its games.
Each seat's conversation is its own (its first messages, then its own turns and what the
environment shows it); a game's reward for a policy is the sum of the rewards the environment gave
its seat.

The protocol (:class:`SeatedEnvironment`): ``seats`` names the seats; ``reset(row)`` and
``step(seat, action)`` return a :class:`SeatStep`: the messages each seat is shown, the rewards
each seat gets, the seat that acts next (None, or ``done``, ends the episode); ``close()`` frees
what the episode holds.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from postrl.rollout.agentic.checks import EnvironmentOutputError, check_messages


@dataclass
class SeatStep:
    """What every seat sees and gets after a reset or a turn, and who acts next."""

    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # appended to each seat's conversation
    next_seat: str | None = None  # None: nobody acts again (the episode is over)
    rewards: dict[str, float] = field(default_factory=dict)  # added to each seat's return
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class SeatedEnvironment(Protocol):
    seats: tuple[str, ...]

    def reset(self, row: dict[str, Any]) -> SeatStep: ...

    def step(self, seat: str, action: str) -> SeatStep: ...

    def close(self) -> None: ...


def check_seat_step(result: Any, seats: tuple[str, ...], where: str) -> SeatStep:
    """``result`` when it is a well-formed :class:`SeatStep` of an environment with ``seats``."""
    if not isinstance(result, SeatStep):
        raise EnvironmentOutputError(f"{where} must return a SeatStep, got {type(result).__name__} {result!r:.60}")
    for seat, messages in result.messages.items():
        _known(seat, seats, f"{where} SeatStep.messages")
        check_messages(messages, f"{where} SeatStep.messages[{seat!r}]")
    for seat, reward in result.rewards.items():
        _known(seat, seats, f"{where} SeatStep.rewards")
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise EnvironmentOutputError(
                f"{where} SeatStep.rewards[{seat!r}] must be a finite number, got {reward!r:.40}"
            )
    if result.next_seat is not None:
        _known(result.next_seat, seats, f"{where} SeatStep.next_seat")
    if not isinstance(result.done, bool):
        raise EnvironmentOutputError(f"{where} SeatStep.done must be a bool, got {type(result.done).__name__}")
    if not isinstance(result.info, dict):
        raise EnvironmentOutputError(f"{where} SeatStep.info must be a dict, got {type(result.info).__name__}")
    return result


def _known(seat: Any, seats: tuple[str, ...], field_name: str) -> None:
    if seat not in seats:
        raise EnvironmentOutputError(f"{field_name} names seat {seat!r}, not one of the environment's {list(seats)}")


def check_seating(env_seats: tuple[str, ...], seating: dict[str, str], env: str) -> None:
    """The environment's seats are exactly those ``agent.seats`` maps (a seat without a policy could
    never act; a seat the environment lacks is a typo)."""
    missing = [s for s in env_seats if s not in seating]
    unknown = [s for s in seating if s not in env_seats]
    if missing or unknown:
        parts = [
            f"names {_seats(unknown)} that the environment does not have (a typo?)" if unknown else "",
            f"leaves {_seats(missing)} of the environment without a policy" if missing else "",
        ]
        raise ValueError(
            f"agent.seats {' and '.join(p for p in parts if p)}: the environment {env} has seats {list(env_seats)}"
        )


def _seats(names: list[str]) -> str:
    return f"seat {names[0]!r}" if len(names) == 1 else f"seats {names}"


def seats_of(env: Any, seating: dict[str, str], env_name: str) -> tuple[str, ...]:
    """The seats of ``env`` when it is a seated environment whose seats are those ``seating``
    maps; a TypeError or ValueError naming what is wrong otherwise."""
    if not isinstance(env, SeatedEnvironment):
        raise TypeError(
            f"agent.env {env_name}: {type(env).__name__} is not a seated environment (seats, "
            "reset(row) -> SeatStep, step(seat, action) -> SeatStep, close())"
        )
    seats = tuple(env.seats)
    check_seating(seats, seating, env_name)
    return seats


def check_seated_game(
    make_env: Callable[..., Any], options: dict[str, Any], seating: dict[str, str], name: str
) -> None:
    """One environment made, checked (seated, its seats those of ``agent.seats``) and closed: a run
    with a wrong seat stops before its first step, not at its first games."""
    env = make_env(**options)
    try:
        seats_of(env, seating, name)
    finally:
        env.close()
