"""Several rollout engines behind the one Rollout Worker interface the Controller calls.

Prompts go to the engine with the least outstanding work (a prompt's work: ``n`` x (prompt +
``max_tokens``) tokens), the G samples of a prompt together on one engine so they share its
prefix. An engine that dies or stops answering is replaced: the new one gets the current weights
before it serves, and the dead one's prompts are generated again, so a step loses no prompt and
counts none twice (a dead engine's partial answers are never used). Engines are added or removed
between steps with :meth:`scale`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from postrl.rollout.common import replay_tokens
from postrl.rollout.weight_transport import WeightTransport
from postrl.types import Health, Prompt, Rollout, SamplingParams, TokenCallback
from postrl.workers import Handle, WorkerDiedError, WorkerTimeoutError

log = logging.getLogger(__name__)
LOST = (WorkerDiedError, WorkerTimeoutError)


class RolloutPoolError(RuntimeError):
    """The pool could not keep enough engines alive to finish a step."""


@dataclass(eq=False)
class EngineSlot:
    index: int
    handle: Handle
    outstanding: int = 0  # tokens of prompts sent and not yet answered
    _joins: bool | None = None  # read from the engine once per handle
    _streams: bool | None = None

    @property
    def joins_calls(self) -> bool:
        """The engine joins concurrent generate calls and its handle lets them run side by side."""
        if self._joins is None:
            self._joins = self.handle.runs_beside("generate") and bool(self.handle.attribute("joins_calls"))
        return self._joins

    @property
    def streams(self) -> bool:
        """The engine is in this process and calls ``on_token`` for every token as it is sampled."""
        if self._streams is None:
            self._streams = self.handle.in_process and bool(self.handle.attribute("streams_tokens"))
        return self._streams

    @property
    def name(self) -> str:
        return self.handle.name


class RolloutPool:
    # generate takes on_token: relayed as sampled from engines in this process that stream, and given
    # for every token of an engine's part when it returns from the others (a process, an actor)
    streams_tokens = True

    def __init__(
        self,
        start_engine: Callable[[int], Handle],
        count: int,
        transport: WeightTransport,
        generate_timeout_s: float | None = None,
        max_restarts: int = 8,
    ) -> None:
        self._start = start_engine
        self.transport = transport
        self.generate_timeout_s = generate_timeout_s
        self.max_restarts = max_restarts
        self.engines = [EngineSlot(i, start_engine(i)) for i in range(count)]
        self._next_index = count
        self.weight_version = 0
        self._weights: tuple[Any, int, dict[str, str] | None] | None = None
        self.restarts = 0
        self.sync_failures = 0  # engines lost during a weight sync (each replaced and synced again)
        self.requeued_prompts = 0
        self._counted: dict[str, float] = {}  # the engines' counters at the last counters() call
        # async mode generates (producer thread) while weights are pushed (sync thread): an engine
        # lost under both is replaced once
        self._replacing = threading.Lock()

    @property
    def joins_calls(self) -> bool:
        """Every engine shares its batch between concurrent generate calls (see RolloutWorker)."""
        return all(slot.joins_calls for slot in self.engines)

    # -- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams,
        weight_version: int | None,
        on_token: TokenCallback | None = None,
    ) -> list[Rollout]:
        """``on_token``: see :attr:`streams_tokens` (a lost engine's prompts, generated again
        elsewhere, give their tokens once: a remote engine's are given only when its part returns)."""
        done: dict[int, list[Rollout]] = {}
        pending = list(range(len(prompts)))
        while pending:
            calls = []
            for slot, indices in self._assign(prompts, pending, sampling_params).items():
                work = sum(self._work(prompts[i], sampling_params) for i in indices)
                slot.outstanding += work
                relay = {"on_token": _relay(on_token, indices)} if on_token is not None and slot.streams else {}
                future = (handle := slot.handle).call_async(
                    "generate",
                    [prompts[i] for i in indices],
                    sampling_params,
                    weight_version,
                    timeout=self.generate_timeout_s,
                    **relay,
                )
                calls.append((slot, handle, indices, work, future, bool(relay)))
            pending = []
            for slot, handle, indices, work, future, relayed in calls:
                try:
                    answered = future.result()
                except LOST as exc:
                    log.warning(
                        "%s was lost during generate (%s); its %d prompts go to the other engines",
                        slot.name,
                        exc,
                        len(indices),
                    )
                    self.requeued_prompts += len(indices)
                    self._replace(slot, str(exc), handle)
                    if self._weights is not None:
                        self._push([slot], *self._weights)
                    pending += indices
                    continue
                finally:
                    slot.outstanding -= work
                mine = [
                    dataclasses.replace(r, prompt_index=indices[r.prompt_index], engine=slot.name) for r in answered
                ]
                for r in mine:
                    done.setdefault(r.prompt_index, []).append(r)
                if on_token is not None and not relayed:
                    replay_tokens(on_token, mine)
        return [r for i in range(len(prompts)) for r in done.get(i, [])]

    def suspend(self) -> bool:
        """Ask the engines to suspend the generate in progress (see ``RolloutWorker.suspend``):
        those whose handle takes a call beside it (in this process); an engine behind a child
        process or an actor finishes its part. True when any engine suspended one."""
        answers = [slot.handle.call("suspend") for slot in list(self.engines) if slot.handle.concurrent]
        return any(answers)

    @staticmethod
    def _work(prompt: Prompt, sp: SamplingParams) -> int:
        return sp.n * (len(prompt.prompt_ids) + sp.max_tokens)

    def _assign(self, prompts: list[Prompt], indices: list[int], sp: SamplingParams) -> dict[EngineSlot, list[int]]:
        """Largest prompts first, each to the engine with the least outstanding work (ties: lowest index)."""
        load = {slot.index: slot.outstanding for slot in self.engines}
        plan: dict[int, list[int]] = {}
        for i in sorted(indices, key=lambda i: (-self._work(prompts[i], sp), i)):
            target = min(self.engines, key=lambda s: (load[s.index], s.index))
            load[target.index] += self._work(prompts[i], sp)
            plan.setdefault(target.index, []).append(i)
        by_index = {slot.index: slot for slot in self.engines}
        return {by_index[k]: sorted(v) for k, v in sorted(plan.items())}

    @property
    def engines_started(self) -> int:
        """Engines ever added to the pool (replacements of lost ones not counted)."""
        return self._next_index

    # -- engines come and go ---------------------------------------------------------------------
    def _replace(self, slot: EngineSlot, cause: str, lost: Handle | None = None) -> None:
        """Start a new engine in ``slot``'s place (the caller gives it the current weights); nothing
        when another thread already replaced ``lost`` (the handle the caller saw fail)."""
        with self._replacing:
            if lost is not None and slot.handle is not lost:
                return
            self.restarts += 1
            if self.restarts > self.max_restarts:
                raise RolloutPoolError(
                    f"{self.restarts} rollout engines were lost in this run (last: {slot.name}: "
                    f"{cause}); stopping instead of restarting more"
                )
            slot.handle.kill()
            slot.handle, slot._joins = self._start(slot.index), None

    def scale(self, count: int) -> None:
        """Add engines (started with the current weights) or remove the newest ones, between steps."""
        if count < 1:
            raise ValueError(f"a rollout pool needs at least one engine, not {count}")
        while len(self.engines) > count:
            self.engines.pop().handle.close()
        while len(self.engines) < count:
            slot = EngineSlot(self._next_index, self._start(self._next_index))
            self._next_index += 1
            self.engines.append(slot)
            if self._weights is not None:
                self._push([slot], *self._weights)

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, weights: Any, version: int, manifest: dict[str, str] | None = None) -> None:
        """Every engine on ``version``; an engine lost during the transfer does not hold up the
        others: it is replaced and the new one is given the same weights."""
        self._weights = (weights, version, manifest)
        self._push(self.engines, weights, version, manifest)
        self.weight_version = version

    def _push(self, slots: list[EngineSlot], weights: Any, version: int, manifest: dict[str, str] | None) -> None:
        todo, lost = list(slots), {}
        for _ in range(self.max_restarts + 1):
            lost = self.transport.push([s.handle for s in todo], weights, version, manifest)
            if not lost:
                return
            self.sync_failures += len(lost)
            for slot in todo:
                if slot.handle.name in lost and not slot.handle.alive():
                    log.warning("%s was lost during a weight sync (%s); restarting it", slot.name, lost[slot.name])
                    self._replace(slot, lost[slot.handle.name], slot.handle)
            todo = [s for s in todo if s.handle.name in lost or not s.handle.alive()]
        reasons = "; ".join(f"{name}: {why}" for name, why in lost.items())
        raise RolloutPoolError(
            f"could not bring {', '.join(s.name for s in todo)} to weight version {version} ({reasons})"
        )

    # -- the rest of the Rollout Worker interface -------------------------------------------------
    def health_check(self) -> bool:
        """Whether every engine serves (:meth:`health` says which does not, and why)."""
        return self.health().ok

    def health(self) -> Health:
        """Every engine serves. An engine lost meanwhile (its process or node gone) is replaced, given
        the current weights and checked once more, as a lost engine is during generate and sync; an
        engine that answers unhealthy, or a replacement that is lost too, fails the check."""
        for slot in self.engines:
            try:
                health = self._checked(slot)
            except LOST as exc:
                return Health(False, f"{slot.name}: {exc}")
            if not health:
                return Health(False, f"{slot.name}: {health.reason}")
        return Health(True)

    def _checked(self, slot: EngineSlot) -> Health:
        handle = slot.handle
        try:
            return handle.call("health", timeout=120)
        except LOST as exc:
            log.warning("%s was lost during a health check (%s); restarting it", slot.name, exc)
            self._replace(slot, str(exc), handle)
            if self._weights is not None:
                self._push([slot], *self._weights)
            return slot.handle.call("health", timeout=120)

    def counters(self) -> dict[str, float]:
        """The engines' counters, summed, as the change since the last call (a step's share); an
        engine replaced meanwhile starts again from 0, so a counter never goes down. An engine lost
        since the step is left out (the next generate or sync replaces it): reading figures never
        fails a step."""
        totals: dict[str, float] = {}
        for slot in self.engines:
            try:
                counted = slot.handle.call("counters", timeout=60)
            except LOST:
                continue
            for name, value in counted.items():
                totals[name] = totals.get(name, 0.0) + value
        change = {name: max(0.0, value - self._counted.get(name, 0.0)) for name, value in totals.items()}
        self._counted = totals
        return change

    def state_dict(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "engines": [slot.handle.call("state_dict", timeout=60) for slot in self.engines],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for slot, engine_state in zip(self.engines, state["engines"]):
            slot.handle.call("load_state_dict", engine_state, timeout=60)
        self.weight_version = int(state["weight_version"])

    def close(self) -> None:
        for slot in self.engines:
            slot.handle.close()


def _relay(on_token: TokenCallback, indices: list[int]) -> TokenCallback:
    """``on_token`` for an engine given ``indices`` of the pool's prompts: its prompt numbers mapped back."""

    def relay(prompt_index: int, *rest: Any) -> None:
        on_token(indices[prompt_index], *rest)

    return relay
