"""Running a postrl HTTP app under uvicorn and saying, once the port is open, where it is."""

from __future__ import annotations

import sys
from typing import Any


def serve_app(app: Any, host: str, port: int, banner: str, **options: Any) -> None:
    """Serve ``app`` until interrupted; print ``banner`` (its URL, what it serves) when it accepts
    connections, not before."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(banner, flush=True)

    _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **options)).run()
    sys.stdout.flush()
