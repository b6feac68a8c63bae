"""The roles of a run as Protocols, all of them here: what the Controller calls, wherever the
worker lives. A scheduler hands each role out as a client made from its Protocol
(:func:`postrl.workers.clients.client`): exactly these methods, each a call of the worker, in this
process, a child process or a Ray actor. The implementations are named apart: the
:class:`~postrl.train.worker.PolicyTrainer`, the engines and :class:`~postrl.rollout.pool.RolloutPool`,
:class:`~postrl.reward.service.LocalRewardService`, :class:`~postrl.train.critic.CriticWorker`, :class:`~postrl.train.dpo.DPOWorker`,
:class:`~postrl.buffer.ExperienceBuffer`, :class:`~postrl.train.teachers.teachers.TeacherSet`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from postrl.types import (
    BufferBatch,
    Experience,
    ExperienceBatch,
    Health,
    PreferencePair,
    Prompt,
    RewardResult,
    Rollout,
    SamplingParams,
    ScoreRequest,
    TrainMetrics,
)
from postrl.types.teaching import TeacherAnswer, TeacherCounts, TeacherQuery


class TrainWorker(Protocol):
    """PPO/GRPO/... updates; one process, or the ranks of an FSDP2 group behind one object."""

    def update(self, batch: ExperienceBatch) -> TrainMetrics: ...

    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """``[B, T-1]`` logprobs of the reference model (a KL needs one), 0 outside the response."""
        ...

    def set_kl_beta(self, beta: float) -> None: ...

    def policy_state(self) -> dict[str, torch.Tensor]: ...

    def save_pretrained(self, folder: str | Path) -> None: ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


class PreferenceTrainer(Protocol):
    """``postrl dpo``'s trainer: the policy's sequence logprobs of chosen and rejected completions."""

    def reference_logprobs(self, pairs: list[PreferencePair]) -> torch.Tensor:
        """``[N, 2]`` (chosen, rejected) under the current weights (before training: the reference)."""
        ...

    def update_pairs(self, pairs: list[PreferencePair], reference: torch.Tensor) -> dict[str, float]: ...

    def save_pretrained(self, folder: str | Path) -> None: ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


class Critic(Protocol):
    """PPO's value model."""

    def values(self, batch: ExperienceBatch) -> torch.Tensor:
        """``[B, T-1]``: the value of every response position, 0 elsewhere."""
        ...

    def update(self, batch: ExperienceBatch) -> dict[str, float]:
        """Train towards the returns ``batch.advantages + batch.values``; the update's metrics."""
        ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


class RewardService(Protocol):
    """Scores (prompt, response) pairs: rules, sandboxed code tests, reward models, a mix."""

    accuracy_component: str | None  # the component whose value counts as correct for ``accuracy``

    def score(self, prompt: str | Prompt, response: str, **columns: Any) -> RewardResult:
        """One response's reward: ``prompt`` its text with ``columns`` (the row's data columns, e.g.
        ``answer``), or a :class:`~postrl.types.Prompt`, whose columns are used and whose
        ``task_type`` picks the components that apply. ``float()`` of the result is the reward."""
        ...

    def score_batch(self, requests: list[ScoreRequest]) -> list[RewardResult]: ...

    def error_count(self) -> int: ...

    def set_log_file(self, path: Path | None) -> None: ...

    def close(self) -> None: ...


class Teachers(Protocol):
    """``algorithm.distill``'s teachers, in ``algorithm.distill.teachers`` order: the logprob of each
    response token of a sample by the teacher its task names (the routing is the config's,
    :meth:`~postrl.config.distill.DistillConfig.teacher_for`)."""

    names: list[str]  # each teacher's name in metrics (teacher/NAME/...)

    def logprobs(self, owners: list[int], queries: list[TeacherQuery]) -> tuple[list[TeacherAnswer], TeacherCounts]:
        """Query ``i``'s answer from teacher ``owners[i]``; a failure of one sample does not fail the others."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RolloutWorker(Protocol):
    weight_version: int
    streams_tokens: ClassVar[bool]  # generate takes on_token (a TokenCallback), called for every token sampled

    @property
    def joins_calls(self) -> bool:
        """Concurrent ``generate`` calls (other threads) share the engine's batch, each returning when
        its own samples are done (continuous batching across callers, e.g. episodes scheduled one by
        one); False: they run one after another, and callers should merge what they send together."""
        ...

    def generate(
        self, prompts: list[Prompt], sampling_params: SamplingParams, weight_version: int | None
    ) -> list[Rollout]:
        """``sampling_params.n`` responses per prompt, grouped by prompt, in prompt order.

        With ``sampling_params.top_logprobs = k`` each rollout also carries the ``k`` most likely
        tokens at every position. Engines that declare ``streams_tokens`` also take an ``on_token``
        keyword (:data:`postrl.types.TokenCallback`), called for every token as it is sampled; the
        server streams whole responses from the others."""
        ...

    def update_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, version: int, manifest: dict[str, str] | None = None
    ) -> None:
        """Load new weights in place; with a manifest (see postrl.models.weights), verify what arrived."""
        ...

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's logprob of every token after its first, untempered (the server's ``echo``
        with ``logprobs``; a distillation teacher's scores); engines that cannot raise
        :class:`postrl.rollout.common.PromptLogprobsUnsupported`."""
        ...

    def suspend(self) -> bool:
        """Ask a ``generate`` in progress (in another thread) to return at its next decode step,
        every unfinished sample with ``finish_reason="suspended"`` and its tokens so far (none for
        samples not yet started); True when a generate was running."""
        ...

    def health_check(self) -> bool:
        """Whether the engine can serve (the seed's check); :meth:`health` has the reason why not."""
        ...

    def health(self) -> Health:
        """Real work, not a flag: the engine checks its weights (and cache) and generates a token, or
        asks its server. Falsy, with the reason, when it cannot serve."""
        ...

    def counters(self) -> dict[str, float]:
        """What the engine has counted since it started, by metric name (the native engine: seconds
        of prefill and decode, weight updates applied in the middle of a generate); {} for none."""
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


class ExperienceStore(Protocol):
    """What the Controller needs of a buffer: :class:`ExperienceBuffer` in this process, or the same
    buffer as a Ray actor behind a client (``scheduler: ray``)."""

    def put(self, experiences: list[Experience]) -> None: ...

    def get(self, batch_size: int | None, current_version: int) -> BufferBatch: ...

    def mark(self) -> None:
        """Remember the buffer as it is (cheaply), for :meth:`rewind`."""
        ...

    def rewind(self) -> None:
        """Back to the last mark: a step abandoned before its update leaves no trace."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...
