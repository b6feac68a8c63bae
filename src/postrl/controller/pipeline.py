"""The step's pipeline: how batches reach the Experience Buffer and new weights reach the engines.

``controller.mode: sync`` (:class:`SyncPipeline`): a step produces its batch (sample, generate,
score, prepare advantages), trains on it and pushes the new weights before the next step begins.

``controller.mode: async``: the producer side runs ahead of training by at most
``buffer.max_staleness`` batches and new weights reach the rollout engines from a background
thread; :class:`ThreadedPipeline` (``overlap: generation``) produces in a thread of its own,
:class:`InlinePipeline` (``overlap: scoring``) generates between two updates and scores beside
training. The producer may start its k-th batch (counted from 1 over the whole run) once the
trainer's version is at least ``k - 1 - max_staleness``, so that the batch, trained at step k under
version ``k - 1``, lags by at most ``max_staleness``; with ``buffer.on_stale: wait`` it also waits
for the engines to hold that version (nothing can go stale), with ``drop`` it generates on whatever
they hold and the buffer drops what went stale. ``max_staleness: 1`` is one-step-off training.

A checkpoint pauses the producer between two batches, so the buffer, the sampler, the engines'
generators and the unconsumed batches' reports are one consistent state: a resumed run trains
every sample once. On 2 cores the threads share the CPU: only waiting (a remote verifier, a
weight transfer) is hidden, not compute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from postrl.controller.generated import Generated
from postrl.controller.step_metrics import StageTimer
from postrl.controller.versions import Versions
from postrl.types import Experience, RewardResult

Weights = dict[str, torch.Tensor]


@dataclass
class ProducedBatch:
    """What the producer side says about one batch it put into the buffer: its metrics (rewards,
    lengths, its own stage timings) and notes for the console."""

    values: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)
    # False: the batch put nothing into the buffer (a policy that took no turn in its episodes), so
    # its step takes nothing and trains nothing
    trainable: bool = True


def ledger_state(produced: int, reports: deque[ProducedBatch]) -> dict[str, Any]:
    """A producer's part of the checkpoint: batches produced in all, the reports not yet consumed."""
    return {"produced": produced, "reports": [(r.values, r.notes, r.trainable) for r in reports]}


def ledger_of(state: dict[str, Any]) -> tuple[int, deque[ProducedBatch]]:
    reports = deque(ProducedBatch(dict(r[0]), dict(r[1]), *(bool(x) for x in r[2:])) for r in state["reports"])
    return int(state["produced"]), reports


class PipelineError(RuntimeError):
    """The producer or the weight-sync thread stopped with an error (the cause is chained)."""


@dataclass
class Batch:
    """A batch in progress: generated (perhaps suspended by a checkpoint), with its stages' timer."""

    generated: Generated
    timer: StageTimer
    alone: bool  # timed on its own (async): its report also says how long it took in all


class BatchSteps(Protocol):
    """What a pipeline does to make a batch (the Controller's producer side implements it)."""

    def begin(self, number: int, timer: StageTimer, alone: bool) -> Batch:
        """Batch ``number``'s prompts drawn and generated."""
        ...

    def resume(self, suspended: Generated) -> Batch:
        """A batch a checkpoint suspended, its rollouts continued."""
        ...

    def score_batch(self, batch: Batch) -> list[RewardResult]: ...

    def finish(self, batch: Batch, rewards: list[RewardResult]) -> tuple[list[Experience], ProducedBatch]:
        """The stages, the advantages, the experiences and the batch's report."""
        ...

    def suspend(self) -> bool:
        """Ask the engines to stop the generate in progress (True when they did)."""
        ...


class Pipeline(Protocol):
    def next_report(self, timer: StageTimer) -> ProducedBatch:
        """The report of the batch this step trains on, once its experiences are in the buffer."""
        ...

    def metrics(self) -> dict[str, float]:
        """The pipeline's own figures for the step's metrics."""
        ...

    def publish(self, state: Weights, version: int) -> None:
        """New weights for the engines (sync: pushed now; async: in the background)."""
        ...

    def give_back(self, report: ProducedBatch | None, taken: bool) -> bool:
        """A step was abandoned before its update: undo what it did (``report``: the batch it was
        given, if it got that far; ``taken``: it took experiences from the buffer). False when that
        cannot be undone."""
        ...

    def paused(self) -> AbstractContextManager[None]:
        """Hold the producer between two batches (for a consistent checkpoint)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop the threads (the producer after its batch in progress); the last weights are on the engines."""
        ...


class SyncPipeline:
    """Each step produces its own batch, and the weights are pushed before the next step. A step
    abandoned before the update is undone by going back to the undo point it started from
    (``snapshot``: the step's own state and a mark of the buffer, not a copy of its contents)."""

    def __init__(
        self,
        steps: BatchSteps,
        deliver: Callable[[list[Experience]], None],
        versions: Versions,
        push: Callable[[Weights, int], None],
        snapshot: Callable[[], dict[str, Any]],
        restore: Callable[[dict[str, Any]], None],
    ) -> None:
        self.steps = steps
        self.deliver = deliver
        self.versions = versions
        self.push = push
        self.snapshot = snapshot
        self.restore = restore
        self._before: dict[str, Any] | None = None

    def next_report(self, timer: StageTimer) -> ProducedBatch:
        self._before = self.snapshot()
        batch = self.steps.begin(self.versions.step + 1, timer, alone=False)
        experiences, report = self.steps.finish(batch, self.steps.score_batch(batch))
        self.deliver(experiences)
        return report

    def metrics(self) -> dict[str, float]:
        return {}

    def publish(self, state: Weights, version: int) -> None:
        self.push(state, version)

    def give_back(self, report: ProducedBatch | None, taken: bool) -> bool:
        if self._before is None:
            return False
        self.restore(self._before)
        return True

    def paused(self) -> AbstractContextManager[None]:
        return nullcontext()  # a checkpoint is taken between two steps, when nothing is produced

    def state_dict(self) -> dict[str, Any]:
        return {}  # no batch outlives its step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A sync run's batches are made within their step: nothing to restore."""

    def close(self) -> None:
        """Nothing runs between steps."""
