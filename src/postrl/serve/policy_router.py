"""One address for several policies' OpenAI-compatible apps (a run with ``policies:``).

A request reaches a policy's app by its path, ``/policies/NAME/...`` (the app sees the path without
the prefix: a framework that fixes its model name is pointed at the policy's base URL), or by the
``model`` its JSON body names (``client.chat.completions.create(model="solver", ...)`` on the
episode's one base URL). ``GET /v1/models`` lists the policies; anything else is refused with the
policies named.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = re.compile(r"^/policies/([^/]+)(/.*)$")


class PolicyRouter:
    """An ASGI app over each policy's app, by name."""

    def __init__(self, apps: Mapping[str, ASGIApp], max_body_bytes: int = 16 << 20) -> None:
        self.apps = dict(apps)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the policies' apps have no startup work of their own
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return await _reply(send, 404, "only HTTP requests are served here", None, "not_found")
        path = scope["path"]
        prefixed = PREFIX.match(path)
        if prefixed is not None:
            name, rest = prefixed.groups()
            if name not in self.apps:
                return await _reply(send, 404, f"no policy '{name}' in this run; {self.named()}", None, "not_found")
            return await self.apps[name]({**scope, "path": rest, "raw_path": rest.encode()}, receive, send)
        if scope["method"] == "GET" and path.rstrip("/").endswith("/v1/models"):
            return await _json(send, 200, {"object": "list", "data": [_model(n) for n in self.apps]})
        if scope["method"] != "POST":
            return await _reply(send, 404, f"{path}: name a policy in the path (/policies/NAME{path}); {self.named()}")
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            return await _reply(send, 413, f"the request body is over {self.max_body_bytes} bytes", None)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            return await _reply(send, 400, "the request body is not a JSON object", None)
        model = request.get("model")
        if model not in self.apps:
            unknown = f"The model '{model}' does not exist; {self.named()}"
            return await _reply(send, 404, unknown, "model", "model_not_found")
        return await self.apps[model](scope, _replay(body, receive), send)

    def named(self) -> str:
        return "this run's policies are " + ", ".join(self.apps) + " (the request's model, or /policies/NAME/...)"


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "postrl"}


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the ``body`` already read, then the connection's own messages (a
    streaming response learns of a client that went away)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _reply(send: Send, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
    kind = "invalid_request_error" if status != 404 else "not_found_error"
    await _json(send, status, {"error": {"message": message, "type": kind, "param": param, "code": code}})


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
