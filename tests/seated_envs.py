"""Seated environments of the tests (tests/test_seats.py): two seats taking turns, each shown its
own conversation, each rewarded for its own turns."""

from __future__ import annotations

import threading
from typing import Any

from postrl.rollout.agentic.seats import SeatStep

ACTIONS: list[tuple[str, str, str]] = []  # (seat, the last message it was shown, its action), every turn
_lock = threading.Lock()


def _digits(text: str) -> float:
    return sum(c.isdigit() for c in text) / 6


class Relay:
    """``writer`` continues the row's prompt, ``reader`` is shown the writer's text and answers it,
    then the writer is shown the reader's answer and writes once more: three turns, the writer
    rewarded for digits in its turns, the reader for digits in its answer."""

    seats = ("writer", "reader")

    def __init__(self, bad: str | None = None) -> None:
        self.bad = bad  # a malformed answer at the second turn (the tests of the checks)
        self.turn = 0
        self.shown: dict[str, str] = {}

    def reset(self, row: dict[str, Any]) -> SeatStep:
        self.shown = {"writer": row["prompt"]}
        return SeatStep({"writer": [{"role": "user", "content": row["prompt"]}]}, next_seat="writer")

    def step(self, seat: str, action: str) -> SeatStep:
        with _lock:
            ACTIONS.append((seat, self.shown[seat], action))
        self.turn += 1
        if self.turn == 2 and self.bad == "seat":
            return SeatStep({"judge": [{"role": "user", "content": "?"}]}, next_seat="writer")
        if self.turn == 2 and self.bad == "reward":
            return SeatStep(rewards={"reader": float("nan")}, done=True)
        if self.turn == 3:
            return SeatStep(rewards={"writer": _digits(action)}, done=True)
        other = "reader" if seat == "writer" else "writer"
        shown = f"{seat} says: {action}"
        self.shown[other] = shown
        rewards = {seat: _digits(action)}
        return SeatStep({other: [{"role": "user", "content": shown}]}, next_seat=other, rewards=rewards)

    def close(self) -> None:
        pass


class NotSeated:
    """A one-seat environment's shape (no seats)."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> None:
        return None

    def close(self) -> None:
        pass


class WriterAlone(Relay):
    """The game ends after the writer's first turn: the reader never acts (no sample for its policy)."""

    def step(self, seat: str, action: str) -> SeatStep:
        with _lock:
            ACTIONS.append((seat, self.shown[seat], action))
        return SeatStep(rewards={"writer": _digits(action), "reader": 1.0}, done=True)


class SlowReader(Relay):
    """The reader's turn takes ``delay`` seconds to answer (past a run's env_timeout_s)."""

    def __init__(self, delay: float = 5.0) -> None:
        super().__init__()
        self.delay = delay

    def step(self, seat: str, action: str) -> SeatStep:
        if seat == "reader":
            import time

            time.sleep(self.delay)
        return super().step(seat, action)
