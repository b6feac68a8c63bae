"""``postrl serve-env``: environments behind HTTP, so a team scales them apart from training.

JSON only, a bearer token when ``--token-env`` names one, a body limit; one environment object
per episode, kept by id until it is closed (or the server stops):

- ``POST /episodes`` ``{"row": {...}}`` -> ``{"episode_id", "messages", "tools"}`` (tool schemas)
- ``POST /episodes/{id}/step`` ``{"action": "..."}`` -> ``{"messages", "reward", "done", "info", "tool_calls"}``
- ``GET /episodes/{id}/state`` -> ``{"state"}`` (environments with ``state_dict``); ``POST /episodes``
  ``{"state": ...}`` restores it as a new episode (after a restart of either side)
- ``DELETE /episodes/{id}`` closes it; ``GET /health`` -> ``{"status", "env", "episodes"}``

An environment that raises (or answers malformed) gets 500 with ``{"detail", "error": {"type",
"message", "reason", "traceback"}}``; a step of an episode that is already done gets 409.
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

from postrl.rollout.agentic.checks import check_messages, check_step_result
from postrl.rollout.agentic.env import Environment, EnvironmentFactory, SavableEnvironment
from postrl.rollout.agentic.limited import describe_failure
from postrl.workers.http_guard import BodyLimitMiddleware, TokenMiddleware


class _ResetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row: dict[str, Any] | None = None
    state: dict[str, Any] | None = None  # an episode saved by GET /episodes/{id}/state, restored


class _StepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: str


class EnvService:
    """The open episodes, one environment object each, by id."""

    def __init__(self, make_env: EnvironmentFactory, options: dict[str, Any], max_episodes: int) -> None:
        self.make_env = make_env
        self.options = options
        self.max_episodes = max_episodes
        self.episodes: dict[str, Environment] = {}
        self.done: set[str] = set()  # episodes whose last step was done: no more steps
        self.lock = threading.Lock()
        self.ids = itertools.count(1)

    async def reset(self, request: Request) -> JSONResponse:
        body = await _body(request, _ResetBody)
        if isinstance(body, JSONResponse):
            return body
        assert isinstance(body, _ResetBody)
        if len(self.episodes) >= self.max_episodes:
            return JSONResponse({"detail": f"{self.max_episodes} episodes are open; close some first"}, status_code=429)
        if (body.row is None) == (body.state is None):
            return JSONResponse({"detail": "send one of row (a new episode) and state (a saved one)"}, status_code=422)
        env: Environment | None = None
        try:
            env = await run_in_threadpool(self.make_env, **self.options)
            if body.state is not None:
                if not isinstance(env, SavableEnvironment):
                    env.close()
                    return JSONResponse(
                        {"detail": "this environment cannot restore episodes (no load_state_dict)"}, status_code=409
                    )
                await run_in_threadpool(env.load_state_dict, body.state)
                messages: list[dict[str, Any]] = []
            else:
                assert body.row is not None
                messages = check_messages(await run_in_threadpool(env.reset, body.row), "reset() messages")
        except Exception as exc:  # the environment's failure, as JSON: the runner ends that episode
            if env is not None:
                await run_in_threadpool(env.close)
            return _raised(exc)
        with self.lock:
            episode = f"ep-{next(self.ids)}"
            self.episodes[episode] = env
        return JSONResponse({"episode_id": episode, "messages": messages, "tools": [t.schema for t in env.tools]})

    async def step(self, episode: str, request: Request) -> JSONResponse:
        body = await _body(request, _StepBody)
        if isinstance(body, JSONResponse):
            return body
        assert isinstance(body, _StepBody)
        env = self.episodes.get(episode)
        if env is None:
            return JSONResponse({"detail": f"no open episode {episode!r}"}, status_code=404)
        if episode in self.done:
            detail = f"episode {episode!r} is done (its last step said so): it takes no more steps; open a new one"
            return JSONResponse({"detail": detail}, status_code=409)
        try:
            result = check_step_result(await run_in_threadpool(env.step, body.action))
        except Exception as exc:  # the environment's failure, reported to the runner (env_error)
            return _raised(exc)
        if result.done:
            self.done.add(episode)
        reply = {"messages": result.messages, "reward": result.reward, "done": result.done, "info": result.info}
        return JSONResponse({**reply, "tool_calls": [dataclasses.asdict(c) for c in result.tool_calls]})

    async def state(self, episode: str) -> JSONResponse:
        env = self.episodes.get(episode)
        if env is None:
            return JSONResponse({"detail": f"no open episode {episode!r}"}, status_code=404)
        if not isinstance(env, SavableEnvironment):
            return JSONResponse({"detail": "this environment cannot save episodes (no state_dict)"}, status_code=409)
        return JSONResponse({"state": await run_in_threadpool(env.state_dict)})

    async def close(self, episode: str) -> JSONResponse:
        with self.lock:
            env = self.episodes.pop(episode, None)
            self.done.discard(episode)
        if env is None:
            return JSONResponse({"detail": f"no open episode {episode!r}"}, status_code=404)
        await run_in_threadpool(env.close)
        return JSONResponse({"closed": episode})

    def close_all(self) -> None:
        with self.lock:
            for env in self.episodes.values():
                env.close()
            self.episodes.clear()


def _raised(exc: Exception) -> JSONResponse:
    """500 with the environment's exception: its type, message, where it was raised and the traceback."""
    reason, text = describe_failure(exc)
    error = {"type": type(exc).__name__, "message": str(exc), "reason": reason, "traceback": text}
    return JSONResponse({"detail": f"the environment raised {reason}", "error": error}, status_code=500)


async def _body(request: Request, model: type[BaseModel]) -> BaseModel | JSONResponse:
    if "application/json" not in request.headers.get("content-type", ""):
        return JSONResponse({"detail": "send JSON (content-type: application/json)"}, status_code=415)
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        return JSONResponse({"detail": f"bad body: {problems}"}, status_code=422)


def build_env_app(
    make_env: EnvironmentFactory,
    name: str,
    options: dict[str, Any] | None = None,
    token: str | None = None,
    max_body_bytes: int = 4 << 20,
    max_episodes: int = 4096,
) -> FastAPI:
    service = EnvService(make_env, options or {}, max_episodes)
    app = FastAPI(title="postrl environment service", on_shutdown=[service.close_all])

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "env": name, "episodes": len(service.episodes)}

    app.post("/episodes")(service.reset)
    app.post("/episodes/{episode}/step")(service.step)
    app.get("/episodes/{episode}/state")(service.state)
    app.delete("/episodes/{episode}")(service.close)
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if token:
        app.add_middleware(TokenMiddleware, token=token)
    return app
