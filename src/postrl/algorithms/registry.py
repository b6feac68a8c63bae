"""Name -> function registries. The registry is the only way the training loop finds an algorithm,
and each entry declares, where it is registered, what it needs from the step (:class:`Needs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Needs:
    """What an entry needs from the step.

    ``groups``: it compares samples of the same prompt (a group baseline), so a run with one sample
    per prompt would learn nothing from it. ``baseline``: it takes the reward of each prompt's
    greedy response (the step generates one per prompt). ``values``: the critic's value of every
    response position (the run needs a critic). ``token_level``: it returns one advantage per
    response token and takes per-token rewards (such as the KL penalty in the reward).
    """

    groups: bool = False
    baseline: bool = False
    values: bool = False
    token_level: bool = False


class Registry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Register ``name`` (a second registration of it is an error)."""

        def decorator(fn: F) -> F:
            self._add(name, fn)
            return fn

        return decorator

    def _add(self, name: str, fn: F) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered (by {self._entries[name].__module__})")
        self._entries[name] = fn

    def names(self) -> list[str]:
        return sorted(self._entries)

    def check(self, name: str) -> str:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} '{name}'; registered: {', '.join(sorted(self._entries))}")
        return name

    def get(self, name: str) -> F:
        return self._entries[self.check(name)]


class AdvantageRegistry(Registry[F]):
    """The advantage estimators: each entry declares, where it is registered, what it needs from the
    step (:class:`Needs`), which drives the config checks and the stages a run gets."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self._needs: dict[str, Needs] = {}

    def register(  # an estimator's needs are declared with it
        self,
        name: str,
        *,
        needs_groups: bool = False,
        needs_baseline: bool = False,
        needs_values: bool = False,
        token_level: bool = False,
    ) -> Callable[[F], F]:
        """Register ``name``; the flags are the entry's :class:`Needs`."""
        needs = Needs(groups=needs_groups, baseline=needs_baseline, values=needs_values, token_level=token_level)

        def decorator(fn: F) -> F:
            self._add(name, fn)
            self._needs[name] = needs
            return fn

        return decorator

    def needs(self, name: str) -> Needs:
        return self._needs[self.check(name)]

    def names_needing(self, where: Callable[[Needs], bool]) -> list[str]:
        """The registered names whose needs match ``where``, sorted."""
        return sorted(n for n in self._entries if where(self._needs[n]))
