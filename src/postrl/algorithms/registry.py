"""Name -> function registries. The registry is the only way the training loop finds an algorithm."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._needs_groups: set[str] = set()
        self._needs_baseline: set[str] = set()

    def register(self, name: str, needs_groups: bool = False, needs_baseline: bool = False) -> Callable[[F], F]:
        """``needs_groups``: the entry compares samples of the same prompt (a group baseline), so a
        run with one sample per prompt would learn nothing from it. ``needs_baseline``: it takes the
        reward of each prompt's greedy response (the loop generates one per prompt)."""

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered (by {self._entries[name].__module__})")
            self._entries[name] = fn
            if needs_groups:
                self._needs_groups.add(name)
            if needs_baseline:
                self._needs_baseline.add(name)
            return fn

        return decorator

    def needs_groups(self, name: str) -> bool:
        return name in self._needs_groups

    def needs_baseline(self, name: str) -> bool:
        return name in self._needs_baseline

    def check(self, name: str) -> str:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} '{name}'; registered: {', '.join(sorted(self._entries))}")
        return name

    def get(self, name: str) -> F:
        return self._entries[self.check(name)]
