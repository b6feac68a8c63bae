"""What every rollout backend shares: the weight-version check, verified weight loading, the
sampling generator's state, and the health report."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file

from postrl.models.weights import verify_manifest
from postrl.types import Health, Prompt, Rollout, SamplingParams, TokenCallback
from postrl.types.progress import phase
from postrl.workers.roles import RolloutWorker


def non_finite(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an inf: one fp32 sum per tensor (a NaN or inf anywhere
    makes it non-finite), read back from the device once."""
    if not named:
        return []
    sums = torch.stack([t.sum(dtype=torch.float32) for _, t in named])
    return [name for (name, _), ok in zip(named, torch.isfinite(sums).tolist()) if not ok]


def http_health(client: Any, url: str, what: str, timeout: float) -> Health:
    """Ask a server's ``/health``: healthy on a 200, else the failure in words."""
    import httpx

    try:
        answer = client.get(url + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        return Health(False, f"{what} {url} did not answer /health: {type(exc).__name__}: {exc}")
    if answer.status_code != 200:
        return Health(False, f"{what} {url} /health answered {answer.status_code}: {answer.text[:200]}")
    return Health(True)


def completions_body(prompts: list[Prompt], sp: SamplingParams) -> dict[str, Any]:
    """The token-in ``/v1/completions`` request of a batch, as the remote engines send it (each adds
    its own fields: logprobs, a seed)."""
    body: dict[str, Any] = {
        "prompt": [p.prompt_ids for p in prompts],
        "n": sp.n,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "max_tokens": sp.max_tokens,
    }
    if sp.stop:
        body["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    return body


class EngineUnhealthyError(RuntimeError):
    """A rollout engine failed its health check; the message is the engine's reason."""


class PromptLogprobsUnsupported(NotImplementedError):
    """The engine cannot give the logprobs of a given sequence (``echo`` with ``logprobs``)."""


class EngineBase:
    """Shared state and checks of a rollout backend (subclasses set up ``generator`` or override
    :meth:`state_dict`)."""

    weight_version: int = 0
    generator: torch.Generator | None = None
    streams_tokens: ClassVar[bool] = False  # generate takes on_token (the engines that sample token by token)
    joins_calls: ClassVar[bool] = False  # concurrent generate calls share one batch (see RolloutWorker)

    def health(self) -> Health:
        """See :meth:`postrl.workers.roles.RolloutWorker.health` (each engine checks its own)."""
        raise NotImplementedError

    def health_check(self) -> bool:
        """Whether the engine can serve; :meth:`health` says why not."""
        return self.health().ok

    def counters(self) -> dict[str, float]:
        """Nothing counted (see :meth:`postrl.workers.roles.RolloutWorker.counters`)."""
        return {}

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """See :meth:`postrl.workers.roles.RolloutWorker.prompt_logprobs`: engines that cannot, say so."""
        raise PromptLogprobsUnsupported(f"the {type(self).__name__} engine does not compute prompt logprobs")

    def suspend(self) -> bool:
        """Ask a ``generate`` in progress to return at once, its unfinished samples ``suspended``
        (tokens so far kept); True when one was running. Engines that cannot stop mid-call finish
        it (False)."""
        return False

    def check_version(self, asked: int | None) -> None:
        """``asked``: the version the caller expects the engine to hold; None: whatever it holds
        (async training, where new weights arrive in the background)."""
        if asked is not None and asked != self.weight_version:
            raise RuntimeError(f"asked to generate with weight_version {asked}, engine holds {self.weight_version}")

    @staticmethod
    def verified_state(
        weights: dict[str, torch.Tensor] | str | Path, manifest: dict[str, str] | None
    ) -> dict[str, torch.Tensor]:
        """The state dict in ``weights`` (a safetensors file or a dict), checked against ``manifest``."""
        state = load_file(str(weights)) if isinstance(weights, (str, Path)) else weights
        if manifest is not None:
            verify_manifest(state, manifest)
        return state

    def seed(self, seed: int | None) -> None:
        if seed is not None and self.generator is not None:
            self.generator.manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"weight_version": self.weight_version}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
        self.weight_version = int(state["weight_version"])

    def close(self) -> None:
        """Release what the engine holds (processes, caches); in-process engines hold nothing to release."""


def replay_tokens(on_token: TokenCallback, rollouts: list[Rollout]) -> None:
    """Token events for responses an engine did not stream: every token of every response, at once
    (the last with its finish reason), the samples of a prompt numbered in order."""
    seen: dict[int, int] = {}
    for r in rollouts:
        sample = seen.get(r.prompt_index, 0)
        seen[r.prompt_index] = sample + 1
        last = len(r.response_ids) - 1
        for t, (token, logprob) in enumerate(zip(r.response_ids, r.logprobs)):
            top = r.top_logprobs[t] if r.top_logprobs else None
            on_token(r.prompt_index, sample, token, logprob, top, r.finish_reason if t == last else None)


def generate_shown(
    engine: RolloutWorker, prompts: list[Prompt], sampling: SamplingParams, version: int | None
) -> list[Rollout]:
    """``engine.generate`` as a ``generate`` phase (:mod:`postrl.types.progress`) whose samples are
    counted as they finish where the engine streams its tokens (else when it returns)."""
    with phase("generate", len(prompts) * sampling.n, "samples") as shown:
        counting = {"on_token": shown.token_counter()} if engine.streams_tokens else {}
        return engine.generate(prompts, sampling, version, **counting)
