"""The Reward Service over HTTP: ``postrl serve-reward --config reward.yaml``.

``POST /score`` takes ``{"samples": [{prompt, response, columns, response_tokens}]}`` and returns
``{"results": [{reward, components, unscorable, error}]}`` in the same order. ``GET /health``
describes the components and the sandbox's protections; ``GET /metrics`` is Prometheus text.
JSON only (nothing is unpickled); bodies over ``server.max_body_bytes`` get 413 before they are
read whole; with a token configured, requests without ``Authorization: Bearer <token>`` get 401
(compared in constant time).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from postrl.config.run import RewardServerConfig
from postrl.reward.service import LocalRewardService, ScoreRequest, result_to_json
from postrl.workers.http_guard import BodyLimitMiddleware, TokenMiddleware

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Sample(BaseModel):
    prompt: str
    response: str
    columns: dict[str, Any] = Field(default_factory=dict)
    response_tokens: int = Field(0, ge=0)


class ScoreBody(BaseModel):
    samples: list[Sample]


class ServerMetrics:
    """Counters and a latency histogram, rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[int, int] = {}
        self.samples = 0
        self.unscorable = 0
        self.in_flight = 0
        self.bucket_counts = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0

    def observe(self, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            self.latency_sum += seconds
            self.latency_count += 1
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.bucket_counts[i] += 1

    def render(self, pool_stats: Any) -> str:
        with self.lock:
            lines = [
                "# HELP postrl_reward_requests_total HTTP requests to /score by status code.",
                "# TYPE postrl_reward_requests_total counter",
                *(f'postrl_reward_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.requests.items())),
                "# HELP postrl_reward_samples_total Samples scored.",
                "# TYPE postrl_reward_samples_total counter",
                f"postrl_reward_samples_total {self.samples}",
                "# HELP postrl_reward_unscorable_total Samples that could not be scored.",
                "# TYPE postrl_reward_unscorable_total counter",
                f"postrl_reward_unscorable_total {self.unscorable}",
                "# HELP postrl_reward_timeouts_total Samples whose scoring process was killed on timeout.",
                "# TYPE postrl_reward_timeouts_total counter",
                f"postrl_reward_timeouts_total {pool_stats.timeouts if pool_stats else 0}",
                "# HELP postrl_reward_worker_restarts_total Scoring processes replaced (timeout or death).",
                "# TYPE postrl_reward_worker_restarts_total counter",
                f"postrl_reward_worker_restarts_total {pool_stats.restarts if pool_stats else 0}",
                "# HELP postrl_reward_in_flight /score requests being handled.",
                "# TYPE postrl_reward_in_flight gauge",
                f"postrl_reward_in_flight {self.in_flight}",
                "# HELP postrl_reward_request_seconds /score latency.",
                "# TYPE postrl_reward_request_seconds histogram",
            ]
            for bound, count in zip(LATENCY_BUCKETS, self.bucket_counts):
                lines.append(f'postrl_reward_request_seconds_bucket{{le="{bound:g}"}} {count}')
            lines += [
                f'postrl_reward_request_seconds_bucket{{le="+Inf"}} {self.latency_count}',
                f"postrl_reward_request_seconds_sum {self.latency_sum:.6f}",
                f"postrl_reward_request_seconds_count {self.latency_count}",
            ]
        return "\n".join(lines) + "\n"


class _Refused(Exception):
    """A /score request refused before scoring: its HTTP status and what is wrong."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


async def _score_body(request: Request, max_batch: int) -> ScoreBody:
    """The request's samples, checked: JSON (415), a valid body naming the bad fields (422), at most
    ``max_batch`` samples (413)."""
    if "application/json" not in request.headers.get("content-type", ""):
        raise _Refused(415, "send JSON (content-type: application/json)")
    try:
        body = ScoreBody.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise _Refused(422, f"bad /score body: {problems}") from None
    if len(body.samples) > max_batch:
        raise _Refused(413, f"{len(body.samples)} samples is over server.max_batch={max_batch}")
    return body


def build_reward_app(service: LocalRewardService, server: RewardServerConfig, token: str | None = None) -> FastAPI:
    app = FastAPI(title="postrl reward service")
    metrics = ServerMetrics()

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "components": [
                {"name": c.name, "type": c.type, "weight": c.weight, "accuracy": c.accuracy} for c in service.components
            ],
            "sandbox_protections": service.sandbox_protections,
            "workers": service.config.num_workers,
        }

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        stats = service.pool.stats if service.pool is not None else None
        return PlainTextResponse(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        start = time.perf_counter()
        with metrics.lock:
            metrics.in_flight += 1
        status = 200
        try:
            body = await _score_body(request, server.max_batch)
            requests = [ScoreRequest(s.prompt, s.response, s.columns, s.response_tokens) for s in body.samples]
            results = await run_in_threadpool(service.score_batch, requests)
            with metrics.lock:
                metrics.samples += len(results)
                metrics.unscorable += sum(r.unscorable for r in results)
            return JSONResponse({"results": [result_to_json(r) for r in results]})
        except _Refused as refused:
            status = refused.status
            return JSONResponse({"detail": refused.detail}, status_code=status)
        except Exception:
            status = 500
            raise
        finally:
            with metrics.lock:
                metrics.in_flight -= 1
            metrics.observe(status, time.perf_counter() - start)

    app.add_middleware(BodyLimitMiddleware, limit=server.max_body_bytes)
    if token:
        app.add_middleware(TokenMiddleware, token=token)  # added last, so it runs first
    return app
