"""Reward terms computed over HTTP: a remote reward-model endpoint and an LLM judge.

Both run in the service process with a bounded number of requests in flight; a failed request
or an unparsable answer makes that sample unscorable with the reason, never a silent 0.

Remote reward model protocol: ``POST url`` with ``{"prompts": [...], "responses": [...]}`` answers
``{"scores": [float, ...]}`` in the same order. The judge uses any OpenAI-compatible
``/chat/completions`` endpoint (``url`` is the API base, e.g. ``http://host:8000/v1``).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from postrl.types import Score
from postrl.workers.http_guard import read_token


def _headers(api_key_env: str | None) -> dict[str, str]:
    key = read_token(api_key_env, "api_key_env")
    return {"Authorization": f"Bearer {key}"} if key else {}


class RemoteRewardModel:
    def __init__(self, url: str, timeout_s: float = 30.0, api_key_env: str | None = None, batch_size: int = 64) -> None:
        self.url = url
        self.batch_size = batch_size
        self.client = httpx.Client(timeout=timeout_s, headers=_headers(api_key_env))

    def score(self, pairs: list[tuple[str, str]]) -> list[Score]:
        out: list[Score] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            out.extend(self._score_chunk(chunk))
        return out

    def _score_chunk(self, chunk: list[tuple[str, str]]) -> list[Score]:
        body = {"prompts": [p for p, _ in chunk], "responses": [r for _, r in chunk]}
        try:
            answer = self.client.post(self.url, json=body)
            answer.raise_for_status()
            scores = answer.json()["scores"]
            if len(scores) != len(chunk):
                raise ValueError(f"sent {len(chunk)} samples, got {len(scores)} scores")
            return [(float(s), None) for s in scores]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            reason = f"remote reward model {self.url}: {type(exc).__name__}: {exc}"
            return [(None, reason)] * len(chunk)

    def close(self) -> None:
        self.client.close()


class LLMJudge:
    def __init__(
        self,
        url: str,
        model: str,
        prompt_template: str,
        score_pattern: str,
        score_scale: float = 10.0,
        timeout_s: float = 60.0,
        api_key_env: str | None = None,
        max_concurrency: int = 8,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.template = prompt_template
        self.scale = score_scale
        self.pattern = re.compile(score_pattern)
        self.client = httpx.Client(
            timeout=timeout_s, headers=_headers(api_key_env), limits=httpx.Limits(max_connections=max_concurrency)
        )
        self.executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="postrl-judge")

    def score(self, items: list[tuple[str, str, dict[str, Any]]]) -> list[Score]:
        return list(self.executor.map(lambda item: self._one(*item), items))

    def _one(self, prompt: str, response: str, columns: dict[str, Any]) -> Score:
        try:
            content = self.template.format(**{**columns, "prompt": prompt, "response": response})
        except (KeyError, IndexError) as exc:
            return None, f"judge prompt_template needs field {exc} that the row does not have"
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0.0}
        try:
            answer = self.client.post(self.endpoint, json=body)
            answer.raise_for_status()
            text = answer.json()["choices"][0]["message"]["content"] or ""
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            return None, f"judge {self.endpoint}: {type(exc).__name__}: {exc}"
        match = self.pattern.search(text)
        if not match:
            return None, f"judge answer has no score matching {self.pattern.pattern!r}: {text[:200]!r}"
        return float(match.group(1)) / self.scale, None

    def close(self) -> None:
        self.executor.shutdown(wait=False)
        self.client.close()
