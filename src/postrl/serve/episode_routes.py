"""``postrl serve-rollout --record``: reading and taking the recorded episodes (the calls themselves
are recorded by :mod:`postrl.serve.chat_completions`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.serve.openai_protocol import bad_request


def add_episode_routes(app: FastAPI, recorder: EpisodeRecorder) -> None:
    """``GET /v1/episodes/{id}`` reads a recording, ``DELETE`` takes it (the trainer's copy)."""

    @app.get("/v1/episodes/{episode}")
    async def episode_view(episode: str) -> dict[str, Any]:
        found = recorder.view(episode)
        if found is None:
            raise bad_request(f"no recorded episode {episode!r}", "episode_id", 404)
        return found

    @app.delete("/v1/episodes/{episode}")
    async def episode_take(episode: str) -> dict[str, Any]:
        found = recorder.view(episode)
        if found is None or recorder.take(episode) is None:
            raise bad_request(f"no recorded episode {episode!r}", "episode_id", 404)
        return found
