"""A Prometheus endpoint on the run's process: ``/metrics`` and ``/health``.

It is a metric sink: each step's metrics (the Controller's own, and the workers' figures that
reach it with the step's results, wherever the workers run) update the series below, named in
docs/observability.md. ``/health`` answers 200 while steps finish and 503 once none has finished
for ``logging.stall_after_s`` seconds (the first step counted from the start), so a hung sync or a
stuck engine shows up without reading logs.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from postrl.config.observability import PrometheusConfig
from postrl.types import StepMetrics
from postrl.types.metric_names import (
    ACCURACY,
    ACTOR_CLIP_FRACTION,
    ACTOR_ENTROPY,
    ACTOR_GRAD_NORM,
    ACTOR_KL,
    BUFFER_DROPPED,
    BUFFER_SIZE,
    PERF_GEN_TOKENS_PER_S,
    PERF_TRAIN_TOKENS_PER_S,
    RESPONSE_CLIP_RATIO,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
    REWARD_SAMPLES,
    REWARD_SERVICE_ERRORS,
    REWARD_UNSCORABLE,
    ROLLOUT_ENGINE_HEALTHY,
    ROLLOUT_ENGINE_RESTARTS,
    ROLLOUT_ENGINES,
    SYNC_BYTES,
    SYNC_FAILURES,
)

PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

# series set from one step metric each: name -> (metric key, help)
GAUGES = {
    "postrl_generated_tokens_per_second": (
        PERF_GEN_TOKENS_PER_S,
        "Response tokens generated per second in the step.",
    ),
    "postrl_trained_tokens_per_second": (PERF_TRAIN_TOKENS_PER_S, "Prompt and response tokens trained per second."),
    "postrl_reward_mean": (REWARD_MEAN, "Mean reward of the step's scored samples."),
    "postrl_accuracy": (ACCURACY, "Share of the step's samples the accuracy component counts as right."),
    "postrl_kl": (ACTOR_KL, "KL of the policy to the reference (actor/kl)."),
    "postrl_entropy": (ACTOR_ENTROPY, "Mean token entropy of the policy on the step's responses."),
    "postrl_response_length_mean": (RESPONSE_LENGTH_MEAN, "Mean response length in tokens."),
    "postrl_response_truncated_ratio": (RESPONSE_CLIP_RATIO, "Share of responses cut at rollout.max_tokens."),
    "postrl_grad_norm": (ACTOR_GRAD_NORM, "Gradient norm before clipping."),
    "postrl_clip_fraction": (ACTOR_CLIP_FRACTION, "Share of tokens whose ratio was clipped."),
    "postrl_sync_bytes": (SYNC_BYTES, "Bytes of the last weight sync."),
    "postrl_engines": (ROLLOUT_ENGINES, "Rollout engines in the pool."),
    "postrl_engine_healthy": (ROLLOUT_ENGINE_HEALTHY, "1 when every engine passed the last health check."),
    "postrl_buffer_size": (BUFFER_SIZE, "Experiences waiting in the Experience Buffer after the step."),
}
# cumulative counts the step metrics carry as running totals: name -> (metric key, help)
TOTALS = {
    "postrl_weight_sync_failures_total": (SYNC_FAILURES, "Engines lost during a weight sync (each replaced)."),
    "postrl_engine_restarts_total": (ROLLOUT_ENGINE_RESTARTS, "Rollout engines restarted after they were lost."),
    "postrl_reward_service_errors_total": (REWARD_SERVICE_ERRORS, "Reward service errors (lost workers, retries)."),
}
# per-step counts, added up: name -> (metric key, help)
COUNTS = {
    "postrl_samples_total": (REWARD_SAMPLES, "Samples scored."),
    "postrl_unscorable_samples_total": (REWARD_UNSCORABLE, "Samples the reward could not score."),
    "postrl_samples_dropped_total": (BUFFER_DROPPED, "Samples dropped for staleness (buffer.max_staleness)."),
}


class PrometheusExporter:
    """``/metrics`` and ``/health`` on ``config.host:config.port`` while the run lasts."""

    def __init__(
        self,
        config: PrometheusConfig,
        stall_after_s: float,
        run: str,
        echo: Callable[[str], None] = print,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stall_after_s = stall_after_s
        self.clock = clock
        self.started = self.last_step_at = clock()
        self.registry = CollectorRegistry()
        self._series(run)
        self._seen: dict[str, float] = {}
        try:
            self.server = ThreadingHTTPServer((config.host, config.port), _handler(self))
        except OSError as exc:
            from postrl.config.run import ConfigError

            raise ConfigError(
                f"logging.prometheus: cannot listen on {config.host}:{config.port} ({exc.strerror or exc}); "
                "choose another logging.prometheus.port, or 0 for any free port"
            ) from None
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="postrl-prometheus", daemon=True)
        self._thread.start()
        echo(f"prometheus: http://{config.host}:{self.port}/metrics (health: /health)")

    def _series(self, run: str) -> None:
        r, labels = self.registry, ["run"]
        self.run = run
        self.phase = Histogram(
            "postrl_step_phase_seconds",
            "Seconds per phase of a step (generate, reward, train, sync, step, ...).",
            ["run", "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.gauges = {n: Gauge(n, h, labels, registry=r) for n, (_, h) in GAUGES.items()}
        self.totals = {n: Counter(n.removesuffix("_total"), h, labels, registry=r) for n, (_, h) in TOTALS.items()}
        self.counts = {n: Counter(n.removesuffix("_total"), h, labels, registry=r) for n, (_, h) in COUNTS.items()}
        self.step = Gauge("postrl_step", "Steps completed.", labels, registry=r)
        self.version = Gauge("postrl_weight_version", "The policy's weight version.", labels, registry=r)
        self.last = Gauge("postrl_last_step_timestamp_seconds", "Unix time the last step finished.", labels, registry=r)
        self.lag = Gauge("postrl_sample_lag", "Versions a step's samples lag the trainer.", ["run", "stat"], registry=r)
        self.memory = Gauge(
            "postrl_peak_memory_bytes", "Peak memory of a role in the step.", ["run", "role"], registry=r
        )
        self.metric = Gauge(
            "postrl_step_metric", "Every scalar of the step, by its metrics.jsonl name.", ["run", "name"], registry=r
        )
        self.last.labels(run).set(self.started)
        for counter in (*self.totals.values(), *self.counts.values()):
            counter.labels(run)  # present at 0 from the start, so that rate() and increase() see the first errors

    def write(self, metrics: StepMetrics) -> None:
        run, values = self.run, metrics.values
        for key, value in values.items():
            if not math.isfinite(value):
                continue
            self.metric.labels(run, key).set(value)
            if key.startswith("time/") and key.endswith("_s"):
                self.phase.labels(run, key[5:-2]).observe(value)
            elif key.startswith("memory/") and key.endswith("_peak_mb"):
                self.memory.labels(run, key[7:-8]).set(value * 2**20)
        for name, (key, _) in GAUGES.items():
            if math.isfinite(values.get(key, math.nan)):
                self.gauges[name].labels(run).set(values[key])
        for name, (key, _) in TOTALS.items():
            grown = values.get(key, 0.0) - self._seen.get(key, 0.0)
            if grown > 0:
                self.totals[name].labels(run).inc(grown)
                self._seen[key] = values[key]
        for name, (key, _) in COUNTS.items():
            if values.get(key, 0.0) > 0:
                self.counts[name].labels(run).inc(values[key])
        for stat in ("mean", "max"):
            if f"buffer/lag_{stat}" in values:
                self.lag.labels(run, stat).set(values[f"buffer/lag_{stat}"])
        self.step.labels(run).set(metrics.step)
        self.version.labels(run).set(metrics.weight_version)
        self.last_step_at = self.clock()
        self.last.labels(run).set(self.last_step_at)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(200 or 503, what it is based on)."""
        idle = self.clock() - self.last_step_at
        stalled = idle > self.stall_after_s
        body = {
            "status": "stalled" if stalled else "ok",
            "seconds_since_last_step": round(idle, 3),
            "stall_after_s": self.stall_after_s,
        }
        return (503 if stalled else 200), body

    def close(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self._thread.join(timeout=5)


def _handler(exporter: PrometheusExporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(exporter.registry))
            elif path == "/health":
                status, body = exporter.health()
                self._send(status, "application/json", json.dumps(body).encode())
            else:
                self._send(404, "text/plain", b"not found: /metrics and /health are served here\n")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: Prometheus scrapes often
            pass

    return Handler
