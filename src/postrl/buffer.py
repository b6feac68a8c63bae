"""Experience buffers. The on-policy buffer holds one step's experiences, handed out once."""

from __future__ import annotations

from postrl.types import Experience


class OnPolicyBuffer:
    """``put`` one step's experiences; ``get`` returns all of them once and empties the buffer.

    ``get`` refuses experiences produced by older weights than ``current_version``: on-policy
    training with stale samples is a bug, not a tuning choice.
    """

    def __init__(self) -> None:
        self._items: list[Experience] = []

    def put(self, experiences: list[Experience]) -> None:
        self._items.extend(experiences)

    def get(self, batch_size: int | None, current_version: int) -> list[Experience]:
        stale = [e.weight_version for e in self._items if e.weight_version != current_version]
        if stale:
            raise RuntimeError(
                f"on-policy buffer holds {len(stale)} experiences from weight_version {sorted(set(stale))}, "
                f"current is {current_version}"
            )
        take = len(self._items) if batch_size is None else batch_size
        out, self._items = self._items[:take], self._items[take:]
        return out

    def __len__(self) -> int:
        return len(self._items)
