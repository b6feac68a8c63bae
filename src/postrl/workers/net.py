"""Small network helpers shared by the servers, the vLLM backend and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port``, ``ray://host:port`` or ``http://host:port/...``; None when the
    address names no port (e.g. Ray's ``auto``)."""
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def url_endpoint(url: str) -> tuple[str, int]:
    """``(host, port)`` of an HTTP(S) URL, the scheme's port where it names none."""
    return host_port(url) or (url.split("://", 1)[-1].split("/", 1)[0], 443 if url.startswith("https") else 80)


def can_connect(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
