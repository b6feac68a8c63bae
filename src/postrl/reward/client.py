"""``RemoteRewardService``: the Reward Service over HTTP, with the in-process service's ``score_batch``.

Pooled keep-alive connections, a per-request timeout, and bounded retries with exponential
backoff and full jitter on connection errors, timeouts and 5xx answers. Anything else (4xx, a
malformed answer, retries exhausted) raises :class:`RewardServiceError` naming the URL and the
cause; the Controller turns that into unscorable samples and its failure-rate check, so a dead
service stops the run with a clear message instead of hanging or scoring failures as 0.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from postrl.config.run import RemoteRewardConfig
from postrl.reward.components import accuracy_component
from postrl.types import Prompt, RewardResult, ScoreRequest
from postrl.workers.http_guard import read_token


class RewardServiceError(RuntimeError):
    """The remote Reward Service could not score a batch."""


class RemoteRewardService:
    def __init__(self, config: RemoteRewardConfig, sleep=time.sleep) -> None:
        self.config = config
        self.base = config.url.rstrip("/")
        self._sleep = sleep
        headers = {}
        try:
            token = read_token(config.token_env, "reward.remote.token_env")
        except ValueError as exc:
            raise RewardServiceError(str(exc)) from None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
        self.client = httpx.Client(timeout=config.timeout_s, headers=headers, limits=limits)
        self.executor = ThreadPoolExecutor(config.max_connections, thread_name_prefix="postrl-reward-client")
        self.retries_done = 0
        self.info = self._request("GET", "/health")
        self.components = self.info.get("components", [])
        self.accuracy_component = accuracy_component(
            [(c["name"], c.get("type", ""), bool(c.get("accuracy"))) for c in self.components]
        )

    def score(self, prompt: str | Prompt, response: str, **columns: Any) -> RewardResult:
        return self.score_batch([ScoreRequest.of(prompt, response, columns)])[0]

    def score_batch(self, requests: list) -> list[RewardResult]:
        """Score in order; batches over ``batch_size`` go as concurrent requests."""
        size = self.config.batch_size
        chunks = [requests[i : i + size] for i in range(0, len(requests), size)]
        out: list[RewardResult] = []
        for part in self.executor.map(self._score_chunk, chunks):
            out.extend(part)
        return out

    def _score_chunk(self, chunk: list) -> list[RewardResult]:
        body = {
            "samples": [
                {"prompt": r.prompt, "response": r.response, "columns": r.columns, "response_tokens": r.response_tokens}
                for r in chunk
            ]
        }
        answer = self._request("POST", "/score", body)
        results = answer.get("results")
        if not isinstance(results, list) or len(results) != len(chunk):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise RewardServiceError(f"{self.base}/score: sent {len(chunk)} samples, got {got} results")
        return [
            RewardResult(
                reward=r["reward"],
                components=r.get("components") or {},
                error=r.get("error"),
                reasons=r.get("reasons") or {},
                flags=r.get("flags") or [],
            )
            for r in results
        ]

    def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        url = self.base + path
        attempts = self.config.retries + 1
        cause = ""
        for attempt in range(attempts):
            if attempt:
                self.retries_done += 1
                delay = self.config.backoff_s * 2 ** (attempt - 1)
                self._sleep(random.uniform(0.0, delay))  # full jitter: spread clients that failed together
            try:
                answer = self.client.request(method, url, json=body)
            except httpx.TransportError as exc:
                cause = f"{type(exc).__name__}: {exc}"
                continue
            if answer.status_code >= 500:
                cause = f"HTTP {answer.status_code}: {answer.text[:200]}"
                continue
            if answer.status_code != 200:
                raise RewardServiceError(f"{url} refused the request: HTTP {answer.status_code}: {answer.text[:300]}")
            try:
                return answer.json()
            except ValueError as exc:
                raise RewardServiceError(f"{url} answered with invalid JSON: {exc}") from None
        raise RewardServiceError(f"{url} failed after {attempts} attempts; last error: {cause}")

    def error_count(self) -> int:
        """Requests that failed and were retried (connection errors, timeouts, 5xx answers)."""
        return self.retries_done

    def set_log_file(self, path: Any) -> None:
        """Scoring runs in the remote service; its workers' output goes to that service's log."""

    def close(self) -> None:
        self.executor.shutdown(wait=False)
        self.client.close()
