"""A teacher behind an OpenAI-compatible URL (``postrl serve-rollout``, vLLM): prompt logprobs from
``/v1/completions`` with ``echo`` and ``logprobs``, the sample's tokens sent as ids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from postrl.train.teachers.teacher import TeacherAnswer, TeacherFailure, TeacherQuery
from postrl.workers.http_guard import read_token


class TeacherServerError(RuntimeError):
    """The teacher's server refused a request or answered something that does not fit it."""


class HTTPTeacher:
    """One request per sample, ``concurrency`` in flight; a sample whose request fails, times out
    or comes back malformed is a :class:`TeacherFailure` (the others are kept). The logprobs are
    the server's own (a vLLM server's prompt logprobs are of its untempered distribution)."""

    def __init__(
        self, url: str, model: str | None, timeout_s: float, api_key_env: str | None, concurrency: int
    ) -> None:
        self.source = url
        self.url = url.rstrip("/").removesuffix("/v1")
        token = read_token(api_key_env, "algorithm.distill.teachers[].api_key_env")
        self.client = httpx.Client(timeout=timeout_s, headers={"authorization": f"Bearer {token}"} if token else {})
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="teacher")
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        try:
            response = self.client.get(self.url + "/v1/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise TeacherServerError(f"teacher {self.source}: cannot list its models (/v1/models): {exc}") from None

    def _echo(self, prompt: list[int] | str) -> dict[str, Any]:
        """The server's echo of ``prompt``: its ``logprobs`` object and the prompt's token count."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1}
        try:
            response = self.client.post(self.url + "/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise TeacherServerError(f"teacher {self.source}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise TeacherServerError(f"teacher {self.source} answered {response.status_code}: {response.text[:300]}")
        try:
            answer = response.json()
            return {
                "logprobs": answer["choices"][0]["logprobs"],
                "prompt_tokens": int(answer["usage"]["prompt_tokens"]),
            }
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise TeacherServerError(f"teacher {self.source}: an answer without echoed logprobs ({exc!r})") from None

    def _one(self, query: TeacherQuery) -> TeacherAnswer:
        try:
            echoed = self._echo(query.ids)
            values = echoed["logprobs"]["token_logprobs"][query.start : len(query.ids)]
        except TeacherServerError as exc:
            return TeacherFailure(str(exc))
        except (KeyError, TypeError) as exc:
            return TeacherFailure(f"teacher {self.source}: echoed logprobs without token_logprobs ({exc!r})")
        wanted = len(query.ids) - query.start
        if len(values) != wanted or any(not isinstance(v, (int, float)) for v in values):
            return TeacherFailure(
                f"teacher {self.source}: {len(values)} prompt logprobs for {wanted} response tokens, or not numbers"
            )
        return [float(v) for v in values]

    def logprobs(self, queries: list[TeacherQuery]) -> list[TeacherAnswer]:
        return list(self.pool.map(self._one, queries))

    def tokenization(self, text: str) -> list[str]:
        echoed = self._echo(text)
        return list(echoed["logprobs"]["tokens"][: echoed["prompt_tokens"]])

    def pieces(self, ids: list[int]) -> list[str]:
        return list(self._echo(ids)["logprobs"]["tokens"][: len(ids)])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
