"""The Rollout Worker interface every backend implements."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from postrl.rollout.common import Health
from postrl.types import Prompt, Rollout, SamplingParams


@runtime_checkable
class RolloutWorker(Protocol):
    weight_version: int

    def generate(
        self, prompts: list[Prompt], sampling_params: SamplingParams, weight_version: int | None
    ) -> list[Rollout]:
        """``sampling_params.n`` responses per prompt, grouped by prompt, in prompt order.

        With ``sampling_params.top_logprobs = k`` each rollout also carries the ``k`` most likely
        tokens at every position. Engines that can stream also take an ``on_token`` keyword
        (:data:`postrl.types.TokenCallback`), called for every token as it is sampled; the
        server's batcher checks for it and streams whole responses from engines without it."""
        ...

    def update_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, version: int, manifest: dict[str, str] | None = None
    ) -> None:
        """Load new weights in place; with a manifest (see postrl.models.weights), verify what arrived."""
        ...

    def suspend(self) -> bool:
        """Ask a ``generate`` in progress (in another thread) to return at its next decode step,
        every unfinished sample with ``finish_reason="suspended"`` and its tokens so far (none for
        samples not yet started); True when a generate was running."""
        ...

    def health_check(self) -> Health:
        """Real work, not a flag: the engine checks its weights (and cache) and generates a token, or
        asks its server. Falsy, with the reason, when it cannot serve."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Release processes and memory; the worker is not used afterwards."""
        ...


class ScalableRolloutWorker(RolloutWorker, Protocol):
    """The Rollout Worker the Controller drives: one or more engines behind one interface
    (:class:`postrl.rollout.pool.RolloutPool`), which can grow and shrink between steps."""

    @property
    def engines(self) -> list[Any]:
        """The engines' handles."""
        ...

    @property
    def restarts(self) -> int:
        """Engines restarted in this run after they were lost."""
        ...

    @property
    def sync_failures(self) -> int:
        """Engines lost during a weight sync in this run (each replaced and synced again)."""
        ...

    def scale(self, engines: int) -> None:
        """Start or stop engines until there are ``engines``; new ones start on the current weights."""
        ...
