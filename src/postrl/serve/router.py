"""Spreads OpenAI-style requests over several rollout servers: least outstanding requests first.

``/health`` reports every backend; ``/update_weights`` is sent to all of them (a sync must reach
every engine, or the router reports which did not take it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse


class LeastOutstandingRouter:
    def __init__(self, backends: list[str], timeout_s: float = 600.0) -> None:
        if not backends:
            raise ValueError("the router needs at least one backend URL")
        self.backends = [b.rstrip("/") for b in backends]
        self.outstanding = {b: 0 for b in self.backends}
        self.served = {b: 0 for b in self.backends}
        self.client = httpx.AsyncClient(timeout=timeout_s)

    def pick(self) -> str:
        return min(self.backends, key=lambda b: (self.outstanding[b], self.served[b]))

    async def forward(self, path: str, body: bytes) -> httpx.Response:
        backend = self.pick()
        self.outstanding[backend] += 1
        try:
            return await self.client.post(backend + path, content=body, headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            raise HTTPException(502, f"backend {backend} failed: {type(exc).__name__}: {exc}") from None
        finally:
            self.outstanding[backend] -= 1
            self.served[backend] += 1

    async def broadcast(self, path: str, body: bytes) -> dict[str, Any]:
        async def one(b: str) -> tuple[str, int, Any]:
            try:
                r = await self.client.post(b + path, content=body, headers={"content-type": "application/json"})
                return b, r.status_code, r.json()
            except httpx.HTTPError as exc:
                return b, 502, {"detail": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(one(b) for b in self.backends))
        return {b: {"status_code": code, "body": body} for b, code, body in results}


def build_router_app(router: LeastOutstandingRouter) -> FastAPI:
    app = FastAPI(title="postrl rollout router")

    @app.post("/v1/{endpoint:path}")
    async def proxy(endpoint: str, request: Request) -> JSONResponse:
        response = await router.forward(f"/v1/{endpoint}", await request.body())
        return JSONResponse(response.json(), status_code=response.status_code)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        response = await router.client.get(router.pick() + "/v1/models")
        return JSONResponse(response.json(), status_code=response.status_code)

    @app.post("/update_weights")
    async def update(request: Request) -> JSONResponse:
        results = await router.broadcast("/update_weights", await request.body())
        failed = [b for b, r in results.items() if r["status_code"] != 200]
        return JSONResponse({"backends": results, "failed": failed}, status_code=502 if failed else 200)

    @app.get("/health")
    async def health() -> JSONResponse:
        async def one(b: str) -> tuple[str, bool]:
            try:
                return b, (await router.client.get(b + "/health")).status_code == 200
            except httpx.HTTPError:
                return b, False

        states = dict(await asyncio.gather(*(one(b) for b in router.backends)))
        ok = all(states.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "backends": states,
                             "outstanding": router.outstanding}, status_code=200 if ok else 503)

    return app
