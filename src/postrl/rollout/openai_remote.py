"""A rollout engine behind an OpenAI-compatible URL: ``postrl serve-rollout``, or several of them
(or postrl's vLLM server) behind ``postrl route``.

Prompts go as token ids to ``/v1/completions`` (G samples per prompt with ``n``); the answer's
``token_ids`` and sampled-token logprobs become the rollouts. New weights are written as one
safetensors file into ``rollout.sync_dir`` (storage the servers read: their ``--weights-dir``) and
announced with ``POST /update_weights`` (the router forwards it to every backend and reports any
that did not take it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import torch

from postrl.models.weights import WeightSyncError, write_sync_file
from postrl.rollout.common import EngineBase, completions_body, http_health
from postrl.types import Health, Prompt, Rollout, SamplingParams


class RemoteEngineError(RuntimeError):
    """The rollout server answered with an error or an answer that does not fit the request."""


class OpenAIRolloutWorker(EngineBase):
    def __init__(
        self, url: str, tokenizer: Any, sync_dir: str | None, api_key_env: str | None = None, timeout_s: float = 3600.0
    ) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.sync_dir = Path(sync_dir) if sync_dir else None
        headers = {}
        if api_key_env:
            token = os.environ.get(api_key_env)
            if not token:
                raise ValueError(f"rollout.api_key_env={api_key_env} is not set in the environment")
            headers["authorization"] = f"Bearer {token}"
        self.client = httpx.Client(timeout=timeout_s, headers=headers)
        self.weight_version = 0

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.client.post(self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"rollout server {self.url}{path}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise RemoteEngineError(
                f"rollout server {self.url}{path} answered {response.status_code}: {response.text[:500]}"
            )
        return response.json()

    def generate(
        self, prompts: list[Prompt], sampling_params: SamplingParams, weight_version: int | None
    ) -> list[Rollout]:
        self.check_version(weight_version)
        sp = sampling_params
        body = {**completions_body(prompts, sp), "logprobs": 0, "include_stop_str_in_output": True}
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * sp.n:
            raise RemoteEngineError(
                f"rollout server {self.url} returned {len(choices)} completions for {len(prompts)} prompts x n={sp.n}"
            )
        out = []
        for choice in choices:
            prompt_index = choice["index"] // sp.n
            ids = list(choice["token_ids"])
            logprobs = list(choice["logprobs"]["token_logprobs"])
            if len(logprobs) != len(ids):
                raise RemoteEngineError(f"rollout server {self.url}: {len(logprobs)} logprobs for {len(ids)} tokens")
            out.append(
                Rollout(
                    prompt_index,
                    prompts[prompt_index].prompt_ids,
                    ids,
                    logprobs,
                    choice["text"],
                    choice["finish_reason"],
                    self.weight_version,
                )
            )
        return out

    def update_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, version: int, manifest: dict[str, str] | None = None
    ) -> None:
        if self.sync_dir is None:
            raise ValueError(
                "rollout.backend=openai needs rollout.sync_dir: a folder the rollout servers read "
                "new weights from (their --weights-dir)"
            )
        if isinstance(weights, dict):
            path = write_sync_file(
                self.verified_state(weights, manifest), self.sync_dir / f"policy-{version}.safetensors"
            )
        else:
            path = Path(weights)
        answer = self._post("/update_weights", {"path": str(path), "version": version, "manifest": manifest})
        if answer.get("failed"):
            raise WeightSyncError(
                f"rollout servers behind {self.url} did not take version {version}: {answer['failed']}"
            )
        for old in self.sync_dir.glob("policy-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        self.weight_version = version

    def health(self) -> Health:
        return http_health(self.client, self.url, "rollout server", timeout=30)

    def close(self) -> None:
        self.client.close()
