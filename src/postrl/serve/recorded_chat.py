"""``postrl serve-rollout --record``: chat calls that name an episode are generated from the
episode's exact tokens and recorded (:mod:`postrl.rollout.agentic.recorder`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.serve.openai_protocol import ChatRequest, bad_request, final_text
from postrl.types import Prompt

if TYPE_CHECKING:
    from postrl.serve.openai_server import OpenAIServer


async def recorded_chat(
    server: OpenAIServer, req: ChatRequest, episode: str, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    """A call of a recorded episode: one choice, not streamed; the engine keeps the episode's K/V
    between its calls (the cache key is the episode)."""
    if server.recorder is None:
        raise bad_request("this server does not record episodes (start it with --record)", "episode_id")
    if req.n != 1 or req.stream:
        raise bad_request("a recorded episode takes n=1 and no streaming", "n" if req.n != 1 else "stream")
    try:
        ids = server.recorder.prompt(episode, messages)
    except ValueError as exc:
        raise bad_request(str(exc), "episode_id", 429) from None
    prompts = [Prompt(text="", prompt_ids=ids, cache_key=f"record:{episode}")]
    k = (req.top_logprobs or 0) if req.logprobs else None
    field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    params = server.sampling(req, prompts, req.max_completion_tokens or req.max_tokens, k or 0, field)
    ends = tuple(server.recorder.renderer.end_of_turn_ids())  # the model's turn ends where the template's does
    params = replace(params, stop_token_ids=tuple(sorted({*params.stop_token_ids, *ends})))
    (r,) = await server.batcher.generate(prompts, params)
    server.recorder.record(episode, r)
    lp = server.chat_logprobs(r.response_ids, r.logprobs, r.top_logprobs, k) if k is not None else None
    message = {"role": "assistant", "content": final_text(r, params, req.include_stop_str_in_output)}
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": r.finish_reason,
        "token_ids": r.response_ids,
        "logprobs": lp,
    }
    return server.envelope("chatcmpl", "chat.completion", [choice], prompts, [r])


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
