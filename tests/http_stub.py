"""A real HTTP server on loopback whose answers a test scripts: ``handler(method, path, body) -> (status, dict)``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Handler = Callable[[str, str, dict], "tuple[int, dict]"]


class LoopbackJSONServer:
    def __init__(self, handler: Handler) -> None:
        self.requests: list[dict[str, Any]] = []  # method, path, auth and the JSON body of each request
        outer = self

        class Endpoint(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                outer.requests.append(
                    {"method": method, "path": self.path, "auth": self.headers.get("authorization"), **body}
                )
                status, answer = handler(method, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
