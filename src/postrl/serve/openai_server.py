"""An OpenAI-compatible HTTP server over a postrl Rollout Worker.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events with
``stream: true``; sampled-token and top-k logprobs; as an extension, the token ids; tools and
structured tool calls, :mod:`postrl.serve.chat_turn`), OpenAI's ``/v1/responses``
(:mod:`postrl.serve.responses_api`) and Anthropic's ``/v1/messages``
(:mod:`postrl.serve.messages_api`), ``/v1/models``, ``/health`` and ``/update_weights`` (a safetensors path under the weights folder
named at start-up, a version, optionally a checksum manifest). Errors use OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body. Parameters the server does not implement
are refused by name, never ignored. Binds loopback unless told otherwise; see
:class:`ServerLimits` for the bounds on each request and :mod:`postrl.workers.http_guard` for the token
and body limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.rollout.common import PromptLogprobsUnsupported
from postrl.serve.batcher import EngineBatcher
from postrl.serve.chat_completions import add_chat_routes
from postrl.serve.chat_turn import ToolsInPrompt
from postrl.serve.episode_routes import add_episode_routes
from postrl.serve.limits import ServerLimits
from postrl.serve.messages_api import add_messages_routes
from postrl.serve.openai_protocol import CompletionRequest, UpdateWeightsRequest, bad_request, final_text
from postrl.serve.responses_api import add_responses_routes
from postrl.serve.sse import ChunkEncoder, SSEStream, choice_factory
from postrl.serve.turn_context import TurnContext
from postrl.types import Prompt, Rollout
from postrl.workers.http_guard import BodyLimitMiddleware, TokenMiddleware, confined_path, detail


class ServerRoutes:
    """The server's own routes, beside the APIs': ``/v1/completions`` and ``/update_weights``."""

    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx

    async def completions(self, req: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        raw = req.prompt
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
        self.ctx.check_request(req, len(items))
        prompts = self.ctx.to_prompts(items)  # type: ignore[arg-type]
        k = req.logprobs
        params = self.ctx.sampling(req, prompts, req.max_tokens, k or 0, "max_tokens")
        if req.echo and req.stream:
            raise bad_request("echo is not supported with stream: true", "echo")
        echoed = await self.echoed_logprobs(prompts) if req.echo and k is not None else None
        if req.stream:
            encoder = ChunkEncoder(self.ctx, req, prompts, chat=False, k=k)
            new_choice = choice_factory(self.ctx, params.stop, req.include_stop_str_in_output, None, chat=False)
            return SSEStream(self.ctx, prompts, params, encoder, new_choice).response()
        rollouts = await self.ctx.batcher.generate(prompts, params)
        choices = []
        for r, sample in numbered(rollouts):
            prompt = prompts[r.prompt_index]
            before = prompt.text if req.echo else ""
            lp = None
            if k is not None:
                lp = self.ctx.completion_logprobs(r.response_ids, r.logprobs, r.top_logprobs, k, len(before))
                if echoed is not None:
                    lp = self.with_prompt(prompt.prompt_ids, echoed[r.prompt_index], lp, k)
            choices.append(
                {
                    "index": r.prompt_index * params.n + sample,
                    "finish_reason": r.finish_reason,
                    "text": before + final_text(r, params, req.include_stop_str_in_output),
                    "token_ids": r.response_ids,
                    "logprobs": lp,
                }
            )
        return self.ctx.envelope("cmpl", "text_completion", choices, prompts, rollouts)

    async def echoed_logprobs(self, prompts: list[Prompt]) -> list[list[float]]:
        """Each prompt's logprob of every token after its first (a 400 where the engine cannot)."""
        try:
            return await self.ctx.batcher.prompt_logprobs([p.prompt_ids for p in prompts])
        except PromptLogprobsUnsupported as exc:
            raise bad_request(f"echo with logprobs: {exc}", "echo") from None

    def with_prompt(self, ids: list[int], scores: list[float], completion: dict[str, Any], k: int) -> dict[str, Any]:
        """OpenAI's echoed logprobs: the prompt's tokens first (the first with a null logprob; each
        prompt position's top_logprobs hold its own token only), then the completion's."""
        prompt = self.ctx.completion_logprobs(ids, [None, *scores], None, 0)  # type: ignore[list-item]
        tops = None
        if completion["top_logprobs"] is not None:
            tops = [None] + [{t: lp} for t, lp in zip(prompt["tokens"][1:], scores)] + completion["top_logprobs"]
        return {
            "tokens": prompt["tokens"] + completion["tokens"],
            "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
            "top_logprobs": tops if k > 0 else None,
            "text_offset": prompt["text_offset"] + completion["text_offset"],
        }

    async def update_weights(self, req: UpdateWeightsRequest) -> dict[str, Any]:
        if self.ctx.limits.weights_dir is None:
            raise bad_request(
                "/update_weights is disabled: start the server with --weights-dir DIR to enable it", "path", 403
            )
        try:
            path = confined_path(self.ctx.limits.weights_dir, req.path)
        except ValueError as exc:
            raise bad_request(str(exc), "path", 403) from None
        if not Path(path).is_file():
            raise bad_request(f"no weights file at {req.path}", "path")
        try:
            await self.ctx.batcher.update_weights(path, req.version, req.manifest)
        except Exception as exc:  # noqa: BLE001 - a bad file is the client's error; the engine keeps its weights
            raise bad_request(f"could not load {req.path}: {type(exc).__name__}: {exc}", "path") from None
        return {"status": "ok", "weight_version": self.ctx.batcher.worker.weight_version}


def numbered(rollouts: list[Rollout]) -> list[tuple[Rollout, int]]:
    """Each rollout with its sample index among the rollouts of its prompt."""
    seen: dict[int, int] = {}
    out = []
    for r in rollouts:
        out.append((r, seen.get(r.prompt_index, 0)))
        seen[r.prompt_index] = out[-1][1] + 1
    return out


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    info = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
        exc.status_code, "invalid_request_error"
    )
    body = {
        "error": {"message": info["message"], "type": kind, "param": info.get("param"), "code": info.get("code")},
        "detail": info["message"],
    }
    return JSONResponse(body, status_code=exc.status_code)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A malformed body is a 400 naming the field, in OpenAI's error shape."""
    problems, first = [], None
    for e in exc.errors()[:5]:
        where = ".".join(str(p) for p in e["loc"] if p != "body")
        first = first or where or None
        problems.append(f"{where}: {e['msg']}" if where else e["msg"])
    message = "; ".join(problems)
    return JSONResponse(
        {
            **detail(message),
            "error": {"message": message, "type": "invalid_request_error", "param": first, "code": None},
        },
        status_code=400,
    )


def build_app(
    batcher: EngineBatcher,
    tokenizer: Any,
    model_name: str,
    default_max_tokens: int = 256,
    max_context: int | None = None,
    limits: ServerLimits | None = None,
    token: str | None = None,
    recorder: EpisodeRecorder | None = None,
    tool_format: str | None = None,
    tools_in_prompt: ToolsInPrompt = "template",
) -> FastAPI:
    """With ``token``, every request needs ``Authorization: Bearer <token>``; with ``recorder``,
    chat requests that name an episode (``episode_id`` or ``X-Episode-Id``) are recorded token
    for token, and ``GET``/``DELETE /v1/episodes/{id}`` read and take a recording."""
    limits = limits or ServerLimits(default_max_tokens=default_max_tokens)
    ctx = TurnContext(batcher, tokenizer, model_name, max_context, limits, recorder, tool_format, tools_in_prompt)
    server = ServerRoutes(ctx)
    app = FastAPI(title="postrl rollout server")
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_body_bytes)
    if token:
        app.add_middleware(TokenMiddleware, token=token)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not batcher.worker.health_check():
            raise HTTPException(503, "engine unhealthy")
        return {"status": "ok", "weight_version": batcher.worker.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": ctx.created, "owned_by": "postrl"}],
        }

    app.post("/v1/completions", response_model=None)(server.completions)
    app.post("/update_weights")(server.update_weights)
    for add_routes in (add_chat_routes, add_responses_routes, add_messages_routes):
        add_routes(app, ctx)
    if recorder is not None:
        add_episode_routes(app, recorder)
    return app
