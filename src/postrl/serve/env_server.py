"""``postrl serve-env``: environments behind HTTP, so a team scales them apart from training.

JSON only, a bearer token when ``--token-env`` names one, a body limit; one environment object
per episode, kept by id until it is closed (or the server stops):

- ``POST /episodes`` ``{"row": {...}}`` -> ``{"episode_id", "messages", "tools"}`` (tool schemas)
- ``POST /episodes/{id}/step`` ``{"action": "..."}`` -> ``{"messages", "reward", "done", "info", "tool_calls"}``
- ``DELETE /episodes/{id}`` closes it; ``GET /health`` -> ``{"status", "env", "episodes"}``
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from postrl.rollout.agentic.env import Environment, EnvironmentFactory
from postrl.workers.http_guard import BodyLimitMiddleware, TokenMiddleware


class _ResetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row: dict[str, Any]


class _StepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: str


def build_env_app(
    make_env: EnvironmentFactory,
    name: str,
    options: dict[str, Any] | None = None,
    token: str | None = None,
    max_body_bytes: int = 4 << 20,
    max_episodes: int = 4096,
) -> FastAPI:
    app = FastAPI(title="postrl environment service")
    episodes: dict[str, Environment] = {}
    lock = threading.Lock()
    ids = itertools.count(1)

    async def body_of(request: Request, model: type[BaseModel]) -> BaseModel | JSONResponse:
        if "application/json" not in request.headers.get("content-type", ""):
            return JSONResponse({"detail": "send JSON (content-type: application/json)"}, status_code=415)
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
            return JSONResponse({"detail": f"bad body: {problems}"}, status_code=422)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "env": name, "episodes": len(episodes)}

    @app.post("/episodes")
    async def reset(request: Request) -> JSONResponse:
        body = await body_of(request, _ResetBody)
        if isinstance(body, JSONResponse):
            return body
        assert isinstance(body, _ResetBody)
        if len(episodes) >= max_episodes:
            return JSONResponse({"detail": f"{max_episodes} episodes are open; close some first"}, status_code=429)
        env = make_env(**(options or {}))
        messages = await run_in_threadpool(env.reset, body.row)
        episode = f"ep-{next(ids)}"
        with lock:
            episodes[episode] = env
        return JSONResponse({"episode_id": episode, "messages": messages, "tools": [t.schema for t in env.tools]})

    @app.post("/episodes/{episode}/step")
    async def step(episode: str, request: Request) -> JSONResponse:
        body = await body_of(request, _StepBody)
        if isinstance(body, JSONResponse):
            return body
        assert isinstance(body, _StepBody)
        env = episodes.get(episode)
        if env is None:
            return JSONResponse({"detail": f"no open episode {episode!r}"}, status_code=404)
        try:
            result = await run_in_threadpool(env.step, body.action)
        except Exception as exc:  # the environment's failure, reported to the runner (env_error)
            return JSONResponse({"detail": f"the environment raised {type(exc).__name__}: {exc}"}, status_code=500)
        return JSONResponse(
            {
                "messages": result.messages,
                "reward": result.reward,
                "done": result.done,
                "info": result.info,
                "tool_calls": [dataclasses.asdict(c) for c in result.tool_calls],
            }
        )

    @app.delete("/episodes/{episode}")
    async def close(episode: str) -> JSONResponse:
        with lock:
            env = episodes.pop(episode, None)
        if env is None:
            return JSONResponse({"detail": f"no open episode {episode!r}"}, status_code=404)
        await run_in_threadpool(env.close)
        return JSONResponse({"closed": episode})

    @app.on_event("shutdown")
    def close_all() -> None:
        with lock:
            for env in episodes.values():
                env.close()
            episodes.clear()

    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if token:
        app.add_middleware(TokenMiddleware, token=token)
    return app
