"""The Experience Buffer: the seam between the producer side of a step (sample, generate, score,
prepare advantages) and the consumer side (train, critic update, sync). Nothing else passes
between the two sides, and in async mode they run in different threads, so every method holds
the buffer's lock.

Staleness: an experience's lag is the consumer's weight version minus the oldest version that
produced one of its tokens (a partial rollout interrupted by a weight update has several). ``get``
never hands out an experience whose lag exceeds ``max_staleness``: with ``on_stale="drop"`` it is
dropped and counted, with ``"wait"`` (the producer was held back so that this cannot happen) it
raises :class:`StaleExperienceError`.

Replay (``replay``): the k-th ``get`` (the trainer's step k) samples seeded random whole groups (the
samples of one prompt) from the batches put for steps k-capacity_steps+1 .. k, each experience at
most ``reuse_limit`` times; older batches leave, batches put ahead (async mode) wait for their step,
and an experience that ages past ``max_staleness`` in the window is dropped and counted. Without
replay every experience is handed out once, oldest put first.

The contents, the counters and the sampling generator's state are in ``state_dict``, so a resumed
run continues exactly.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass
from typing import Any

from postrl.config.off_policy import ReplayConfig
from postrl.types import BufferBatch, Experience


class StaleExperienceError(RuntimeError):
    """The buffer holds experiences older than the staleness bound allows."""


def oldest_version(e: Experience) -> int:
    """The oldest weight version behind any of the experience's tokens."""
    return min(e.logprob_versions) if e.logprob_versions else e.weight_version


@dataclass
class _Entry:
    experience: Experience
    serial: int  # which put it came in (a step's batch)
    uses: int = 0


@dataclass(frozen=True)
class _Mark:
    entries: list[tuple[_Entry, int]]  # each entry held, with its uses then
    counters: tuple[int, int, int, int, int]
    rng: Any


class ExperienceBuffer:
    def __init__(
        self, max_staleness: int = 0, on_stale: str = "wait", replay: ReplayConfig | None = None, seed: int = 0
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if on_stale not in ("wait", "drop"):
            raise ValueError(f"on_stale must be 'wait' or 'drop', got {on_stale!r}")
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.replay = replay
        self._entries: list[_Entry] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.put_count = self.got_count = self.dropped_count = self.serial = self.gets = 0
        self._mark: _Mark | None = None

    def put(self, experiences: list[Experience]) -> None:
        """One producer batch (a step's experiences); none is no put (its step takes nothing, see
        :attr:`~postrl.controller.pipeline.ProducedBatch.trainable`)."""
        if not experiences:
            return
        with self._lock:
            self.serial += 1
            self._entries.extend(_Entry(e, self.serial) for e in experiences)
            self.put_count += len(experiences)

    def get(self, batch_size: int | None, current_version: int) -> BufferBatch:
        """Up to ``batch_size`` experiences for a trainer at ``current_version``; None: the oldest
        put's (one producer batch; with replay, every experience held)."""
        with self._lock:
            self.gets += 1
            if self.replay is not None:  # the window: the batches of the last capacity_steps steps
                oldest = self.gets - self.replay.capacity_steps + 1
                self._entries = [x for x in self._entries if x.serial >= oldest]
            dropped = self._drop_stale(current_version)
            chosen = self._sample(batch_size) if self.replay is not None else self._oldest(batch_size)
            for entry in chosen:
                entry.uses += 1
            limit = 1 if self.replay is None else self.replay.reuse_limit
            self._entries = [x for x in self._entries if x.uses < limit]
            self.got_count += len(chosen)
            return BufferBatch(
                _renumbered_groups(chosen), [current_version - oldest_version(x.experience) for x in chosen], dropped
            )

    def _drop_stale(self, current_version: int) -> int:
        """Stale experiences leave (counted); with on_stale=wait and no replay they are a bug (the
        producer was held back), with replay they aged in the window."""
        stale = [x for x in self._entries if current_version - oldest_version(x.experience) > self.max_staleness]
        if not stale:
            return 0
        if self.on_stale == "wait" and self.replay is None:
            versions = sorted({oldest_version(x.experience) for x in stale})
            raise StaleExperienceError(
                f"the experience buffer holds experiences from weight_version {versions}, current is "
                f"{current_version} (buffer.max_staleness={self.max_staleness}, on_stale=wait)"
            )
        gone = {id(x) for x in stale}
        self._entries = [x for x in self._entries if id(x) not in gone]
        self.dropped_count += len(stale)
        return len(stale)

    def _oldest(self, batch_size: int | None) -> list[_Entry]:
        if batch_size is None:
            first = self._entries[0].serial if self._entries else 0
            return [x for x in self._entries if x.serial == first]
        return self._entries[:batch_size]

    def _sample(self, batch_size: int | None) -> list[_Entry]:
        """Seeded random whole groups of the window's batches (none put ahead of this step), until
        the next group would pass ``batch_size``."""
        groups: dict[tuple[int, int | None], list[_Entry]] = {}
        for i, x in enumerate(self._entries):
            if x.serial > self.gets:
                continue
            key = (x.serial, x.experience.group_id if x.experience.group_id is not None else -1 - i)
            groups.setdefault(key, []).append(x)
        order = list(groups.values())
        self._rng.shuffle(order)
        chosen: list[_Entry] = []
        for members in order:
            if batch_size is not None and len(chosen) + len(members) > batch_size:
                break
            chosen.extend(members)
        return chosen

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        """Nothing to release (its contents are in the checkpoint)."""

    def mark(self) -> None:
        """Remember the buffer as it is now, for :meth:`rewind`: its entries and counters, not
        copies of the experiences (cheap, where :meth:`state_dict` copies every one)."""
        with self._lock:
            self._mark = _Mark(
                [(x, x.uses) for x in self._entries],
                (self.put_count, self.got_count, self.dropped_count, self.serial, self.gets),
                self._rng.getstate(),
            )

    def rewind(self) -> None:
        """Back to the last :meth:`mark` (a step abandoned before its update)."""
        with self._lock:
            if self._mark is None:
                raise RuntimeError("rewind() without a mark()")
            for entry, uses in self._mark.entries:
                entry.uses = uses
            self._entries = [entry for entry, _ in self._mark.entries]
            self.put_count, self.got_count, self.dropped_count, self.serial, self.gets = self._mark.counters
            self._rng.setstate(self._mark.rng)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "entries": [
                    {"experience": dataclasses.asdict(x.experience), "serial": x.serial, "uses": x.uses}
                    for x in self._entries
                ],
                "counters": [self.put_count, self.got_count, self.dropped_count, self.serial, self.gets],
                "rng": self._rng.getstate(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._entries = [
                _Entry(Experience(**x["experience"]), int(x["serial"]), int(x["uses"])) for x in state["entries"]
            ]
            self.put_count, self.got_count, self.dropped_count, self.serial, self.gets = (
                int(c) for c in state["counters"]
            )
            self._rng.setstate(_as_rng_state(state["rng"]))


def _renumbered_groups(chosen: list[_Entry]) -> list[Experience]:
    """Group ids are unique within one put (a step's prompts): across puts they are made unique,
    numbered by first appearance (the trainer only compares them)."""
    ids: dict[tuple[int, int], int] = {}
    out = []
    for i, x in enumerate(chosen):
        gid = x.experience.group_id
        key = (x.serial, gid if gid is not None else -1 - i)
        out.append(dataclasses.replace(x.experience, group_id=ids.setdefault(key, len(ids))))
    return out


def _as_rng_state(state: Any) -> tuple:
    """``random.Random`` state from a checkpoint (lists where tuples were)."""
    version, internal, gauss = state
    return (int(version), tuple(int(v) for v in internal), gauss)
