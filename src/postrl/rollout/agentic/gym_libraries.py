"""Environments of the field's gym-style libraries as postrl environments (``agent.env``):

- ``textarena:<game id>`` — a TextArena single-player game (``postrl[textarena]``), e.g.
  ``textarena:Mastermind-v0``; the game's raw variant, so each turn's message is what is new
  (not the whole history again); the reward is the game's at its end. With ``agent.seats`` a
  game of several players (``textarena:TicTacToe-v0``), each player a seat (``player_0``,
  ``player_1``, ...) played by a policy (:class:`TextArenaSeats`, :mod:`.seats`);
- ``skyrl_gym:<env id>`` — a skyrl-gym text environment (``postrl[skyrl]``), e.g.
  ``skyrl_gym:gsm8k_multi_turn``, made per episode from the row (``reward_spec``, ``extra_info``;
  without ``reward_spec``, the row's ``answer`` is the ground truth); its per-turn rewards add up;
- ``gem:<env id>`` — a GEM environment (``postrl[gem]``), e.g. ``gem:game:Mastermind-v0-easy``.

Seeds: an episode's seed is its row's ``seed`` column, else a number derived from the row, so the
n episodes of a prompt play the same game and a second run plays the same games. TextArena and GEM
seed Python's (and numpy's) process-wide generators; each episode here has its own generator states,
swapped in under one lock around every reset and step, so concurrent episodes never draw from one
another's streams and an episode's game does not depend on how the threads interleave.
"""

from __future__ import annotations

import json
import random
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from postrl.rollout.agentic.env import StepResult, first_messages
from postrl.rollout.agentic.seats import SeatStep
from postrl.rollout.agentic.tools import Tool

LIBRARIES = {"textarena": "postrl[textarena]", "skyrl_gym": "postrl[skyrl]", "gem": "postrl[gem]"}
_GLOBAL_RANDOM = threading.Lock()  # the process-wide generators are one resource


class MissingGameData(RuntimeError):
    """A game needs data files it would download at run time (NLTK corpora), and they are not here."""


def episode_seed(row: dict[str, Any]) -> int:
    """The row's ``seed``, else a stable number from the row's content."""
    if row.get("seed") is not None:
        return int(row["seed"])
    content = {k: v for k, v in row.items() if k != "messages" or v is not None}
    return zlib.crc32(json.dumps(content, sort_keys=True, default=str).encode()) % (2**31)


def _capture() -> tuple[Any, Any]:
    import numpy as np

    return random.getstate(), np.random.get_state()


def _restore(state: tuple[Any, Any]) -> None:
    import numpy as np

    random.setstate(state[0])
    np.random.set_state(state[1])


class EpisodeRandom:
    """One episode's own states of Python's and numpy's process-wide generators."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        with _GLOBAL_RANDOM:
            outside = _capture()
            random.seed(seed)
            np.random.seed(seed % (2**32))
            self.state = _capture()
            _restore(outside)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The episode's generators in place (under the lock) for one call into the library."""
        with _GLOBAL_RANDOM:
            outside = _capture()
            _restore(self.state)
            try:
                yield
            finally:
                self.state = _capture()
                _restore(outside)


def _library(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(f"agent.env={name}:...: {name} is not installed: pip install '{LIBRARIES[name]}'") from None


@contextmanager
def _no_downloads(game: str) -> Iterator[None]:
    """NLTK's downloader refused (it would wait on the network), and the lookup error that follows
    turned into :class:`MissingGameData` naming what the game needs."""
    try:
        import nltk
    except ImportError:
        yield
        return
    asked: list[str] = []
    real = nltk.download

    def refuse(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        asked.append(str(info_or_id))
        return False

    nltk.download = refuse
    try:
        yield
    except LookupError:
        names = list(dict.fromkeys(asked)) or ["see NLTK's LookupError"]
        raise MissingGameData(
            f"TextArena game {game} needs NLTK data that is not installed ({', '.join(names)}); the game downloads "
            f"it at run time, which needs a network: install it where there is one (python -m nltk.downloader "
            f"{' '.join(names)}) into a folder on NLTK_DATA, or choose another game"
        ) from None
    finally:
        nltk.download = real


def _text(observations: list[Any]) -> str:
    """TextArena's new observations, ``(from, message, type)`` each, as one message; the echo of
    the player's own action is left out (the conversation has it as the model's turn)."""
    from textarena.core import ObservationType

    kept = [o for o in observations if not (isinstance(o, tuple) and o[2] == ObservationType.PLAYER_ACTION)]
    return "\n".join(str(o[1]) if isinstance(o, tuple) else str(o) for o in kept).strip()


def _textarena_game(game: str, options: dict[str, Any]) -> Any:
    """TextArena's ``game`` (its raw variant where there is one), made with ``options``; an unknown
    game is refused naming its variants."""
    ta = _library("textarena")
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        near = sorted(g for g in ENV_REGISTRY if g.split("-")[0].lower() == game.split("-")[0].lower())[:5]
        raise ValueError(f"TextArena has no game '{game}'" + (f" (its variants: {', '.join(near)})" if near else ""))
    raw = f"{game}-raw" if f"{game}-raw" in ENV_REGISTRY else game
    with _no_downloads(game):
        return ta.make(raw, **options)


class TextArenaEnvironment:
    tools: list[Tool] = []

    def __init__(self, game: str, **options: Any) -> None:
        self.game = game
        self.env = _textarena_game(game, options)
        self.random: EpisodeRandom | None = None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        seed = episode_seed(row)
        self.random = EpisodeRandom(seed)
        with self.random.active(), _no_downloads(self.game):
            self.env.reset(num_players=1, seed=seed)
            players = self.env.state.num_players
            if players != 1:
                raise ValueError(
                    f"TextArena game {self.game} has {players} players; agent.env takes single-player games"
                )
            _, observations = self.env.get_observation()
        return [{"role": "user", "content": _text(observations)}]

    def step(self, action: str) -> StepResult:
        assert self.random is not None, "reset() first"
        with self.random.active():
            done, info = self.env.step(action)
            if done:
                rewards, game_info = self.env.close()
                reward = float((rewards or {}).get(0, 0.0))
                return StepResult([], reward=reward, done=True, info={"game": _jsonable(game_info)})
            _, observations = self.env.get_observation()
        return StepResult([{"role": "user", "content": _text(observations)}], info={"step": _jsonable(info)})

    def close(self) -> None:
        self.random = None


def _seat_text(observations: list[Any], player: int) -> str:
    """A player's new observations as one message: the other players' moves kept, the echo of its
    own left out (its conversation has it as its turn)."""
    from textarena.core import ObservationType

    def own_action(o: Any) -> bool:
        return isinstance(o, tuple) and o[2] == ObservationType.PLAYER_ACTION and o[0] == player

    return "\n".join(str(o[1]) if isinstance(o, tuple) else str(o) for o in observations if not own_action(o)).strip()


def seat_name(player: int) -> str:
    return f"player_{player}"


class TextArenaSeats:
    """A TextArena game of several players as a seated environment: player ``i`` is seat
    ``player_i``; each turn the acting player is shown what is new to it (the other players' moves
    among it), and at the end each seat gets the game's reward of its player."""

    def __init__(self, game: str, num_players: int = 2, **options: Any) -> None:
        self.game = game
        self.num_players = num_players
        self.seats = tuple(seat_name(i) for i in range(num_players))
        self.env = _textarena_game(game, options)
        self.random: EpisodeRandom | None = None

    def reset(self, row: dict[str, Any]) -> SeatStep:
        seed = episode_seed(row)
        self.random = EpisodeRandom(seed)
        with self.random.active(), _no_downloads(self.game):
            self.env.reset(num_players=self.num_players, seed=seed)
            return self._next()

    def step(self, seat: str, action: str) -> SeatStep:
        assert self.random is not None, "reset() first"
        with self.random.active():
            done, info = self.env.step(action)
            if done:
                rewards, game_info = self.env.close()
                scores = {seat_name(int(p)): float(r) for p, r in (rewards or {}).items()}
                return SeatStep(rewards=scores, done=True, info={"game": _jsonable(game_info)})
            return self._next(info)

    def _next(self, info: Any = None) -> SeatStep:
        player, observations = self.env.get_observation()
        seat = seat_name(int(player))
        shown = {seat: [{"role": "user", "content": _seat_text(observations, int(player))}]}
        return SeatStep(shown, next_seat=seat, info={} if info is None else {"step": _jsonable(info)})

    def close(self) -> None:
        self.random = None


class SkyRLGymEnvironment:
    tools: list[Tool] = []

    def __init__(self, env_id: str, env_config: dict[str, Any] | None = None, max_turns: int | None = None) -> None:
        self.gym = _library("skyrl_gym")
        if env_id not in self.gym.envs.registration.registry:
            known = ", ".join(sorted(self.gym.envs.registration.registry))
            raise ValueError(f"skyrl-gym has no environment '{env_id}' (registered: {known})")
        self.env_id = env_id
        self.env_config = env_config or {}
        self.max_turns = max_turns
        self.env: Any = None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        reward_spec = row.get("reward_spec") or {"method": "rule", "ground_truth": row.get("answer")}
        extras: dict[str, Any] = {"reward_spec": reward_spec, "extra_info": row.get("extra_info") or {}}
        if self.max_turns is not None:
            extras["max_turns"] = self.max_turns
        from omegaconf import OmegaConf

        self.env = self.gym.make(self.env_id, env_config=OmegaConf.create(self.env_config), extras=extras)
        messages, _ = self.env.init(first_messages(row))
        return [dict(m) for m in messages]

    def step(self, action: str) -> StepResult:
        out = self.env.step(action)
        return StepResult(
            [dict(m) for m in out["observations"]],
            reward=float(out["reward"]),
            done=bool(out["done"]),
            info=_jsonable(out.get("metadata") or {}),
        )

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class GemEnvironment:
    tools: list[Tool] = []

    def __init__(self, env_id: str, **options: Any) -> None:
        gem = _library("gem")
        from gem.envs.registration import ENV_REGISTRY

        if env_id not in ENV_REGISTRY:
            near = sorted(e for e in ENV_REGISTRY if env_id.split("-")[0] in e)[:6]
            raise ValueError(f"GEM has no environment '{env_id}'" + (f" (close: {', '.join(near)})" if near else ""))
        self.env_id = env_id
        self.env = gem.make(env_id, **options)
        self.random: EpisodeRandom | None = None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        seed = episode_seed(row)
        self.random = EpisodeRandom(seed)
        with self.random.active():
            observation, _ = self.env.reset(seed=seed)
        return [{"role": "user", "content": str(observation)}]

    def step(self, action: str) -> StepResult:
        assert self.random is not None, "reset() first"
        with self.random.active():
            observation, reward, terminated, truncated, info = self.env.step(action)
        done = bool(terminated or truncated)
        messages = [] if done else [{"role": "user", "content": str(observation)}]
        return StepResult(messages, reward=float(reward), done=done, info=_jsonable(info))

    def close(self) -> None:
        self.random = None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


ADAPTERS: dict[str, Callable[..., Any]] = {
    "textarena": TextArenaEnvironment,
    "skyrl_gym": SkyRLGymEnvironment,
    "gem": GemEnvironment,
}


def library_environment(spec: str) -> Callable[..., Any] | None:
    """The factory for ``library:env id`` (``skyrl-gym:`` also reads as ``skyrl_gym:``), None when
    ``spec`` names no library."""
    library, _, env_id = spec.partition(":")
    library = library.replace("-", "_")
    if library not in ADAPTERS or not env_id:
        return None
    adapter = ADAPTERS[library]
    return lambda **options: adapter(env_id, **options)


SEATED_ADAPTERS: dict[str, Callable[..., Any]] = {"textarena": TextArenaSeats}


def seated_library_environment(spec: str) -> Callable[..., Any] | None:
    """The factory of ``library:game id``'s games of several players (seats), None when ``spec``
    names no library that has them."""
    library, _, env_id = spec.partition(":")
    adapter = SEATED_ADAPTERS.get(library.replace("-", "_"))
    if adapter is None or not env_id:
        return None
    return lambda **options: adapter(env_id, **options)
