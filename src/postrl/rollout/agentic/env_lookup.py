"""An ``agent.env`` spec to the factory of its environments: a registered name, an environment
library's id, a ``postrl serve-env`` URL or a user's ``module:attribute``."""

from __future__ import annotations

from postrl.config.imports import import_callable
from postrl.rollout.agentic.env import ENVIRONMENTS, EnvironmentFactory
from postrl.rollout.agentic.gym_libraries import library_environment
from postrl.rollout.agentic.remote_env import RemoteEnvironment


def environment_factory(spec: str) -> EnvironmentFactory:
    """A registered environment's name, ``library:env id`` of TextArena, skyrl-gym or GEM,
    ``module:attribute`` of a user's package, or the URL of ``postrl serve-env``."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    library = library_environment(spec)  # textarena:..., skyrl_gym:..., gem:...
    if library is not None:
        return library
    if spec.startswith(("http://", "https://")):  # postrl serve-env
        return lambda **options: RemoteEnvironment(spec, **options)
    if ":" not in spec:
        raise ValueError(
            f"agent.env: unknown environment '{spec}' (registered: {', '.join(sorted(ENVIRONMENTS))}; or module:Class)"
        )
    return import_callable(spec, "agent.env")
