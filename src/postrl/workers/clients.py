"""How the Controller reaches a worker, wherever it lives: a client made from the worker's role
Protocol (:mod:`postrl.workers.roles`) over a handle.

:func:`client` binds exactly the Protocol's methods, each a :meth:`Handle.call` of the same name,
and its attributes, read once; it checks them against the worker when it is made, so a method the
worker lacks (a typo, a stale worker class) fails at start-up, naming the worker and the method,
instead of mid-run. Adding a method to a role is then one line in its Protocol and the method in
its implementation. With the local scheduler's :class:`~postrl.workers.handles.InProcessHandle`
a call is a direct call of the object. Errors arrive typed (:mod:`postrl.workers.errors`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

from postrl.types import Prompt, RewardResult, ScoreRequest
from postrl.workers.handles import Handle, WorkerDiedError, WorkerTimeoutError
from postrl.workers.roles import RewardService

log = logging.getLogger(__name__)
R = TypeVar("R")


class RoleMismatchError(TypeError):
    """A worker does not have every method of the role it was placed for."""


def role_members(protocol: type) -> tuple[list[str], list[str]]:
    """The methods (with ``__len__``) and the data attributes a role Protocol declares, its bases' included."""
    methods: set[str] = set()
    attributes: set[str] = set()
    for klass in protocol.__mro__:
        if klass in (object, Protocol, Generic):
            continue
        for name, value in vars(klass).items():
            if callable(value) and (not name.startswith("_") or name == "__len__"):
                methods.add(name)
            elif isinstance(value, property) and not name.startswith("_"):
                attributes.add(name)
        attributes |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
    return sorted(methods), sorted(attributes - methods)


class RoleClient:
    """The base of every client :func:`client` makes: its handle and its calls' timeout."""

    def __init__(self, handle: Handle, timeout: float | None) -> None:
        self.handle = handle
        self.timeout = timeout


def _remote_method(name: str) -> Callable[..., Any]:
    if name == "close":  # the worker releases what it holds and its process ends
        return lambda self: self.handle.close()

    def call(self: RoleClient, *args: Any, **kwargs: Any) -> Any:
        return self.handle.call(name, *args, timeout=self.timeout, **kwargs)

    call.__name__ = name
    return call


@functools.cache
def client_class(protocol: type) -> type[RoleClient]:
    """The one client class of a role Protocol (made once): a method per method of the Protocol."""
    methods, _ = role_members(protocol)
    return type(f"{protocol.__name__}Client", (RoleClient,), {name: _remote_method(name) for name in methods})


def client(handle: Handle, protocol: type[R], timeout: float | None = None) -> R:
    """``protocol``'s methods over ``handle`` (each call under ``timeout`` seconds), its attributes
    (constants of the worker, such as the Reward Service's accuracy component) read once; raises
    :class:`RoleMismatchError` when the worker lacks a method."""
    methods, attributes = role_members(protocol)
    missing = sorted(set(methods) - handle.methods())
    if missing:
        raise RoleMismatchError(
            f"{handle.name} is placed as a {protocol.__name__} but has no {', '.join(missing)} "
            f"(see postrl.workers.roles.{protocol.__name__})"
        )
    made = client_class(cast(type, protocol))(handle, timeout)
    for name in attributes:
        setattr(made, name, handle.attribute(name))
    return cast(R, made)


class RewardServiceClient:
    """The Reward Service behind a handle, started again when it is lost: with ``restart`` (a
    function that starts it again), a service that dies or stops answering is started again and the
    batch scored again (scoring has no side effects), up to ``max_restarts`` times in a run."""

    def __init__(
        self,
        handle: Handle,
        timeout: float | None = None,
        restart: Callable[[], Handle] | None = None,
        max_restarts: int = 8,
    ) -> None:
        self.timeout = timeout
        self.restart = restart
        self.max_restarts = max_restarts
        self.restarts = 0
        self.handle = handle
        self.service = client(handle, RewardService, timeout)
        self.accuracy_component = self.service.accuracy_component
        self._log_file: Path | None = None

    def set_log_file(self, path: Path | None) -> None:
        self._log_file = path
        self.service.set_log_file(path)

    def error_count(self) -> int:
        """The service's own errors (lost scoring workers, retried requests) and its restarts here."""
        return self.restarts + int(self.service.error_count())

    def score(self, prompt: str | Prompt, response: str, **columns: Any) -> RewardResult:
        return self.score_batch([ScoreRequest.of(prompt, response, columns)])[0]

    def score_batch(self, requests: list[ScoreRequest]) -> list[RewardResult]:
        while True:
            try:
                return self.service.score_batch(requests)
            except (WorkerDiedError, WorkerTimeoutError) as exc:
                self.restarts += 1
                if self.restart is None or self.restarts > self.max_restarts:
                    raise
                log.warning("the reward service was lost (%s); starting it again and rescoring", exc)
                self.handle.kill()
                self.handle = self.restart()
                self.service = client(self.handle, RewardService, self.timeout)
                if self._log_file is not None:
                    self.service.set_log_file(self._log_file)

    def close(self) -> None:
        self.service.close()
