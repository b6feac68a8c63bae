"""An ``agent.env`` spec to the factory of its environments: a registered name, an environment
library's id, a ``postrl serve-env`` URL or a user's ``module:attribute``."""

from __future__ import annotations

from postrl.config.imports import import_callable
from postrl.rollout.agentic.env import ENVIRONMENTS, EnvironmentFactory
from postrl.rollout.agentic.gym_libraries import library_environment, seated_library_environment
from postrl.rollout.agentic.remote_env import RemoteEnvironment


def environment_factory(spec: str) -> EnvironmentFactory:
    """A registered environment's name, ``library:env id`` of TextArena, skyrl-gym or GEM,
    ``openenv:URL`` of an OpenEnv server, ``module:attribute`` of a user's package, or the URL of
    ``postrl serve-env``."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    library = library_environment(spec)  # textarena:..., skyrl_gym:..., gem:...
    if library is not None:
        return library
    if spec.startswith(("http://", "https://")):  # postrl serve-env
        return lambda **options: RemoteEnvironment(spec, **options)
    if spec.startswith("openenv:"):
        return openenv_factory(spec.removeprefix("openenv:"))
    if ":" not in spec:
        raise ValueError(
            f"agent.env: unknown environment '{spec}' (registered: {', '.join(sorted(ENVIRONMENTS))}; or module:Class)"
        )
    return import_callable(spec, "agent.env")


def openenv_factory(url: str) -> EnvironmentFactory:
    """``openenv:URL``: an OpenEnv server, one session of OpenEnv's own client per episode."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"agent.env: openenv:{url}: give the server's URL (openenv:http://host:port) or its app "
            "(openenv:module:app, served by postrl)"
        )
    from postrl.rollout.agentic.openenv_env import OpenEnvEnvironment

    return lambda **options: OpenEnvEnvironment(url, **options)


def seated_environment_factory(spec: str) -> EnvironmentFactory:
    """The factory of a seated environment (``agent.seats``, :mod:`.seats`): a library's game of
    several players (``textarena:TicTacToe-v0``), or a registered name or ``module:Class`` whose
    objects are seated environments (checked when the first episode makes one)."""
    library = seated_library_environment(spec)
    if library is not None:
        return library
    if spec.startswith(("http://", "https://")):
        raise ValueError("agent.seats: a postrl serve-env URL serves one-seat environments; seated ones run in-process")
    if library_environment(spec) is not None:
        raise ValueError(f"agent.env={spec}: this library has no games of several players in postrl (textarena has)")
    return environment_factory(spec)
