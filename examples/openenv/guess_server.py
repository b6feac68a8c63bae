"""An OpenEnv environment server written against ``openenv-core``'s server API, as such servers are
(the tests' and benchmarks/env_hubs.py's): ``python examples/openenv/guess_server.py PORT [KIND]``,
or ``agent.env: openenv:guess_server:app`` with this folder on the import path (postrl serves it).

The game: guess a digit. ``reset(seed)`` picks it (``seed % 10``); each step's action is
``{"guess": TEXT}``; the observation says higher, lower or correct; a correct guess ends the
episode with reward 1, three wrong ones with reward 0.

KIND ``slow``: every step takes 30 s. KIND ``blank``: every step's observation has nothing to show.
"""

from __future__ import annotations

import sys
import time
import uuid

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

KIND = sys.argv[2] if len(sys.argv) > 2 and __name__ == "__main__" else "game"


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.target, self.tries = 0, 0
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target, self.tries = (seed or 0) % 10, 0
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(message="Guess a digit from 0 to 9.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if KIND == "slow":
            time.sleep(30)
        self.tries += 1
        self._state.step_count += 1
        if KIND == "blank":
            return GuessObservation(done=False, reward=0.0)
        digits = [c for c in action.guess if c.isdigit()]
        guess = int(digits[0]) if digits else -1
        if guess == self.target:
            return GuessObservation(message="Correct.", done=True, reward=1.0)
        hint = "higher" if guess < self.target else "lower"
        return GuessObservation(message=f"No: {hint}.", done=self.tries >= 3, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=16)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
