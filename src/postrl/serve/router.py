"""Spreads OpenAI-style requests over several rollout servers: least outstanding requests first,
around failures.

A backend that fails a health check (``GET /health`` every ``health_interval_s``) or a request
(no connection, a timeout, a 5xx answer) leaves the rotation until a health check passes again.
Failed *requests* add a back-off that doubles with each one in a row (so a backend whose health
check passes but whose requests fail does not flap back in at every check); failed health checks
during an outage do not, so a backend that is healthy again rejoins at the next check;
the failed request is retried once on another backend (for a stream: when the failure comes
before the first byte). ``/health`` reports every backend; ``/update_weights`` is sent to all of
them (a sync must reach every engine, or the router reports which did not take it).

Recorded episodes are sticky: every request of an episode (its base URL ``/episodes/ID/v1``, an
``episode_id`` in the body or ``X-Episode-Id``) and ``GET``/``DELETE /v1/episodes/ID`` go to the
backend that served its first request, where its recording is; if that backend is down the
request fails (503 naming the episode) rather than starting a broken recording elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from postrl.workers.http_guard import detail

log = logging.getLogger(__name__)
MAX_STICKY_EPISODES = 100_000  # episodes whose backend the router remembers (the oldest are forgotten)


@dataclass
class Backend:
    url: str
    healthy: bool = True
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    consecutive: int = 0  # failures since the last success: re-admission waits longer each time
    out_until: float = 0.0  # monotonic time before which a passing health check does not re-admit it
    last_error: str | None = None


class NoBackendError(RuntimeError):
    """Every backend is out of the rotation (``none_healthy``), or the request failed on two of them."""

    def __init__(self, message: str, none_healthy: bool = False) -> None:
        super().__init__(message)
        self.none_healthy = none_healthy


class LeastOutstandingRouter:
    def __init__(
        self, backends: list[str], timeout_s: float = 600.0, health_interval_s: float = 5.0, token: str | None = None
    ) -> None:
        if not backends:
            raise ValueError("the router needs at least one backend URL")
        self.state = {b.rstrip("/"): Backend(b.rstrip("/")) for b in backends}
        self.backends = list(self.state)
        self.health_interval_s = health_interval_s
        self.token = token
        self.client = httpx.AsyncClient(timeout=timeout_s)
        self.sticky: OrderedDict[str, str] = OrderedDict()  # episode -> the backend that records it

    # -- bookkeeping, kept for callers that read these maps ------------------------------------
    @property
    def outstanding(self) -> dict[str, int]:
        return {b: s.outstanding for b, s in self.state.items()}

    @property
    def served(self) -> dict[str, int]:
        return {b: s.served for b, s in self.state.items()}

    def pick(self, exclude: tuple[str, ...] = ()) -> str:
        live = [s for s in self.state.values() if s.healthy and s.url not in exclude]
        if not live:
            down = "; ".join(f"{s.url}: {s.last_error or 'unhealthy'}" for s in self.state.values())
            raise NoBackendError(f"no healthy backend to send the request to ({down})", none_healthy=not exclude)
        return min(live, key=lambda s: (s.outstanding, s.served)).url

    def backend_of(self, episode: str) -> str:
        """The backend that records ``episode``: the least busy healthy one at the episode's first
        request, the same one for every request after (its recording is there); an episode whose
        backend is down cannot go on elsewhere."""
        url = self.sticky.get(episode)
        if url is None:
            url = self.pick()
            self.sticky[episode] = url
            if len(self.sticky) > MAX_STICKY_EPISODES:
                self.sticky.popitem(last=False)
        elif not self.state[url].healthy:
            raise NoBackendError(
                f"the backend recording episode {episode} ({url}) is down: {self.state[url].last_error or 'unhealthy'}",
                none_healthy=True,
            )
        self.sticky.move_to_end(episode)
        return url

    def mark_failed(self, url: str, error: str, backoff: bool = True) -> None:
        """Take a backend out of the rotation; a failed request (``backoff``) also delays its return."""
        backend = self.state[url]
        backend.failures += 1
        if backoff:
            backend.consecutive += 1
            backend.out_until = time.monotonic() + min(60.0, self.health_interval_s * 2 ** (backend.consecutive - 1))
        backend.last_error = error
        if backend.healthy:
            log.warning("backend %s leaves the rotation: %s", url, error)
        backend.healthy = False

    def headers(self, request_headers: Any = None) -> dict[str, str]:
        out = {"content-type": "application/json"}
        auth = f"Bearer {self.token}" if self.token else (request_headers or {}).get("authorization")
        if auth:
            out["authorization"] = auth
        episode = (request_headers or {}).get("x-episode-id")
        if episode:
            out["x-episode-id"] = episode
        return out

    # -- health ----------------------------------------------------------------------------------
    async def check(self, url: str) -> bool:
        try:
            ok = (await self.client.get(url + "/health", headers=self.headers(), timeout=10)).status_code == 200
            error = None if ok else "health check did not answer 200"
        except httpx.HTTPError as exc:
            ok, error = False, f"health check failed: {type(exc).__name__}: {exc}"
        backend = self.state[url]
        if not ok:
            self.mark_failed(url, error or "unhealthy", backoff=False)
        elif not backend.healthy and time.monotonic() >= backend.out_until:
            log.warning("backend %s is healthy again and rejoins the rotation", url)
            backend.healthy, backend.last_error = True, None
        return ok

    async def check_all(self) -> dict[str, bool]:
        return dict(zip(self.backends, await asyncio.gather(*(self.check(b) for b in self.backends))))

    async def health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.health_interval_s)

    # -- forwarding ------------------------------------------------------------------------------
    async def _twice(
        self, attempt: Callable[[str], Awaitable[tuple[Any, str | None]]], episode: str | None = None
    ) -> Any:
        """Run ``attempt(url)`` on the least busy healthy backend and, if it fails (returns an
        error), once more on another; a failed backend leaves the rotation. A request of a recorded
        ``episode`` goes to the episode's backend only."""
        if episode is not None:
            url = self.backend_of(episode)
            result, error = await attempt(url)
            if error is None:
                return result
            self.mark_failed(url, error)
            raise NoBackendError(
                f"the request of episode {episode} failed on its backend {url}: {error}", none_healthy=True
            )
        tried: list[str] = []
        errors: list[str] = []
        for _ in range(2):
            try:
                url = self.pick(exclude=tuple(tried))
            except NoBackendError as exc:
                if not tried:
                    raise
                errors.append(str(exc))
                break
            tried.append(url)
            result, error = await attempt(url)
            if error is None:
                return result
            self.mark_failed(url, error)
            errors.append(f"{url}: {error}")
        raise NoBackendError("the request failed on " + "; then on ".join(errors))

    async def forward(
        self,
        path: str,
        body: bytes | None,
        request_headers: Any = None,
        method: str = "POST",
        episode: str | None = None,
    ) -> httpx.Response:
        """Send to the least busy healthy backend (``episode``: to the one recording it); on a
        failure, once more to another."""

        async def attempt(url: str) -> tuple[httpx.Response | None, str | None]:
            backend = self.state[url]
            backend.outstanding += 1
            try:
                response = await self.client.request(
                    method, url + path, content=body, headers=self.headers(request_headers)
                )
            except httpx.HTTPError as exc:
                return None, f"{type(exc).__name__}: {exc}"
            finally:
                backend.outstanding -= 1
                backend.served += 1
            if response.status_code >= 500:
                return None, f"HTTP {response.status_code}: {response.text[:200]}"
            backend.consecutive = 0
            return response, None

        return await self._twice(attempt, episode)

    async def open_stream(
        self, path: str, body: bytes, request_headers: Any = None, episode: str | None = None
    ) -> tuple[str, httpx.Response]:
        """Start a streamed POST; retried on another backend only while nothing has been relayed."""

        async def attempt(url: str) -> tuple[tuple[str, httpx.Response] | None, str | None]:
            request = self.client.build_request("POST", url + path, content=body, headers=self.headers(request_headers))
            try:
                response = await self.client.send(request, stream=True)
            except httpx.HTTPError as exc:
                self.state[url].served += 1
                return None, f"{type(exc).__name__}: {exc}"
            if response.status_code >= 500:
                await response.aread()
                await response.aclose()
                self.state[url].served += 1
                return None, f"HTTP {response.status_code}: {response.text[:200]}"
            self.state[url].outstanding += 1
            self.state[url].consecutive = 0
            return (url, response), None

        return await self._twice(attempt, episode)

    async def broadcast(self, path: str, body: bytes, request_headers: Any = None) -> dict[str, Any]:
        async def one(b: str) -> tuple[str, int, Any]:
            try:
                r = await self.client.post(b + path, content=body, headers=self.headers(request_headers))
                try:
                    payload = r.json()
                except ValueError:
                    payload = {"detail": r.text[:300]}
                return b, r.status_code, payload
            except httpx.HTTPError as exc:
                return b, 502, {"detail": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(one(b) for b in self.backends))
        return {b: {"status_code": code, "body": body} for b, code, body in results}


def _add_forwarding_routes(app: FastAPI, router: LeastOutstandingRouter) -> None:
    """``POST /v1/...`` and ``/episodes/ID/v1/...`` to a backend (an episode's own, see
    :meth:`LeastOutstandingRouter.backend_of`); a recording read or taken where it is."""

    async def relay(path: str, request: Request, episode: str | None) -> Response:
        body = await request.body()
        try:
            if _wants_stream(body):
                url, upstream = await router.open_stream(path, body, request.headers, episode)
                return _relay(router, url, upstream)
            response = await router.forward(path, body, request.headers, episode=episode)
        except NoBackendError as exc:
            return _no_backend(exc)
        return _answer(response)

    @app.post("/v1/{endpoint:path}")
    async def proxy(endpoint: str, request: Request) -> Response:
        body = await request.body()
        return await relay(f"/v1/{endpoint}", request, _episode_named(body, request.headers))

    @app.post("/episodes/{episode}/v1/{endpoint:path}")
    async def proxy_episode(episode: str, endpoint: str, request: Request) -> Response:
        return await relay(f"/episodes/{episode}/v1/{endpoint}", request, episode)

    @app.api_route("/v1/episodes/{episode}", methods=["GET", "DELETE"])
    async def recorded(episode: str, request: Request) -> Response:
        try:
            response = await router.forward(
                f"/v1/episodes/{episode}", None, request.headers, method=request.method, episode=episode
            )
        except NoBackendError as exc:
            return _no_backend(exc)
        if request.method == "DELETE":
            router.sticky.pop(episode, None)
        return _answer(response)


def _answer(response: httpx.Response) -> Response:
    return Response(
        response.content,
        status_code=response.status_code,
        media_type=response.headers.get("content-type", "application/json"),
    )


def _episode_named(body: bytes, headers: Any) -> str | None:
    """The episode a ``/v1`` request records into (``episode_id`` in its body, or ``X-Episode-Id``)."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    named = payload.get("episode_id") if isinstance(payload, dict) else None
    return str(named) if named else headers.get("x-episode-id")


def _wants_stream(body: bytes) -> bool:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


def build_router_app(router: LeastOutstandingRouter) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()

    app = FastAPI(title="postrl rollout router", lifespan=lifespan)
    _add_forwarding_routes(app, router)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            response = await router.forward("/v1/models", None, request.headers, method="GET")
        except NoBackendError as exc:
            return _no_backend(exc)
        return _answer(response)

    @app.post("/update_weights")
    async def update(request: Request) -> JSONResponse:
        results = await router.broadcast("/update_weights", await request.body(), request.headers)
        failed = [b for b, r in results.items() if r["status_code"] != 200]
        return JSONResponse({"backends": results, "failed": failed}, status_code=502 if failed else 200)

    @app.get("/health")
    async def health() -> JSONResponse:
        await router.check_all()
        states = {b: s.healthy for b, s in router.state.items()}
        ok = all(states.values())
        body = {
            "status": "ok" if ok else "degraded",
            "backends": states,
            "outstanding": router.outstanding,
            "errors": {b: s.last_error for b, s in router.state.items() if s.last_error},
        }
        return JSONResponse(body, status_code=200 if any(states.values()) else 503)

    return app


def _no_backend(exc: NoBackendError) -> JSONResponse:
    """503 when no backend is in the rotation, 502 when the request failed on those tried; either way
    the message names every backend with its last error."""
    return JSONResponse(detail(str(exc)), status_code=503 if exc.none_healthy else 502)


def _relay(router: LeastOutstandingRouter, url: str, upstream: httpx.Response) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            router.mark_failed(url, f"stream broke: {type(exc).__name__}: {exc}")
            yield f"data: {json.dumps(detail(f'backend {url} failed mid-stream: {exc}'))}\n\n".encode()
        finally:
            router.state[url].outstanding -= 1
            router.state[url].served += 1
            await upstream.aclose()

    return StreamingResponse(
        chunks(), status_code=upstream.status_code, media_type=upstream.headers.get("content-type", "text/event-stream")
    )
