"""Protections shared by postrl's HTTP servers: a bearer token checked in constant time, a request
body limit enforced while the body is read, loopback detection and file paths confined to a folder.

Only the standard library is imported here, so the vLLM server script (which runs in vLLM's own
environment, without postrl installed) loads this file by path.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Callable
from typing import Any

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(env_name: str | None, what: str = "--token-env") -> str | None:
    """The token held by the environment variable ``env_name``; an unset or empty variable is an error."""
    if not env_name:
        return None
    token = os.environ.get(env_name)
    if not token:
        raise ValueError(f"{what} {env_name}: that environment variable is not set (or empty)")
    return token


def confined_path(base_dir: str, path: str) -> str:
    """``path`` resolved (symlinks included); ValueError unless it lies inside ``base_dir``."""
    base = os.path.realpath(base_dir)
    full = os.path.realpath(path if os.path.isabs(path) else os.path.join(base, path))
    if os.path.commonpath([base, full]) != base:
        raise ValueError(f"{path} is outside the weights folder {base_dir} named at start-up")
    return full


async def send_json(send: Any, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def detail(message: str) -> dict[str, Any]:
    """An error body that both FastAPI clients ({"detail"}) and OpenAI clients ({"error"}) read."""
    return {
        "detail": message,
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None},
    }


class TokenMiddleware:
    """ASGI middleware: 401 unless ``Authorization: Bearer <token>`` matches (constant-time compare).

    ``protect(path)`` says which paths need it; by default all of them."""

    def __init__(self, app: Any, token: str, protect: Callable[[str], bool] | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.protect = protect or (lambda path: True)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.protect(scope.get("path", "")):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await send_json(
                    send,
                    401,
                    {
                        **detail("missing or wrong bearer token"),
                        "error": {
                            "message": "missing or wrong bearer token",
                            "type": "authentication_error",
                            "param": None,
                            "code": "invalid_api_key",
                        },
                    },
                )
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """ASGI middleware: 413 once a request body exceeds ``limit`` bytes, whether or not it declares a length."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await send_json(
                send, 413, detail(f"request body of {int(declared)} bytes is over the {self.limit}-byte limit")
            )
            return
        body = bytearray()
        while True:  # read the body here, stopping at the limit, then hand it on whole
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.limit:
                await send_json(send, 413, detail(f"request body is over the {self.limit}-byte limit"))
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
