"""The Experience Buffer: the seam between the producer side of a step (sample, generate, score,
prepare advantages) and the consumer side (train, critic update, sync). Nothing else passes
between the two sides.

Today's runs are synchronous and on-policy: the producer puts one step's experiences, the consumer
gets all of them once, and the staleness bound is 0 (an experience from older weights than the
trainer's is a bug, and ``get`` raises). The interface is the one asynchronous training needs:
``get`` by the consumer's current weight version under a staleness bound, and the contents and
counters in ``state_dict`` so that a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from postrl.types import Experience


class StaleExperienceError(RuntimeError):
    """The buffer holds experiences older than the staleness bound allows."""


class ExperienceBuffer:
    """``put`` experiences; ``get`` hands each out once, oldest first.

    ``max_staleness``: the largest ``current_version - weight_version`` an experience may have when
    it is handed out. An experience beyond it raises :class:`StaleExperienceError`, naming the
    versions (on-policy training with stale samples is a bug, not a tuning choice).
    """

    def __init__(self, max_staleness: int = 0) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._items: list[Experience] = []
        self.put_count = 0
        self.got_count = 0

    def put(self, experiences: list[Experience]) -> None:
        self._items.extend(experiences)
        self.put_count += len(experiences)

    def get(self, batch_size: int | None, current_version: int) -> list[Experience]:
        """Up to ``batch_size`` experiences (None: all of them)."""
        stale = sorted(
            {e.weight_version for e in self._items if current_version - e.weight_version > self.max_staleness}
        )
        if stale:
            raise StaleExperienceError(
                f"the experience buffer holds experiences from weight_version {stale}, current is "
                f"{current_version} (max_staleness={self.max_staleness})"
            )
        take = len(self._items) if batch_size is None else batch_size
        out, self._items = self._items[:take], self._items[take:]
        self.got_count += len(out)
        return out

    def __len__(self) -> int:
        return len(self._items)

    def state_dict(self) -> dict[str, Any]:
        return {
            "items": [dataclasses.asdict(e) for e in self._items],
            "put_count": self.put_count,
            "got_count": self.got_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._items = [Experience(**item) for item in state["items"]]
        self.put_count, self.got_count = int(state["put_count"]), int(state["got_count"])
