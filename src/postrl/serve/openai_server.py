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

import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.rollout.agentic.template_check import tools_reach_prompt
from postrl.serve.batcher import EngineBatcher
from postrl.serve.chat_completions import chat_completion
from postrl.serve.chat_turn import Tooling, ToolsInPrompt
from postrl.serve.episode_routes import add_episode_routes
from postrl.serve.limits import ServerLimits
from postrl.serve.messages_api import MessagesRequest, create_message
from postrl.serve.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    UpdateWeightsRequest,
    bad_request,
    check_parameters,
    final_text,
)
from postrl.serve.responses_api import ResponsesRequest, create_response
from postrl.serve.sse import ChunkEncoder, SSEStream, choice_factory
from postrl.serve.tool_formats import tool_format as find_tool_format
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.workers.http_guard import BodyLimitMiddleware, TokenMiddleware, confined_path, detail

PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_7", "parameters": {"type": "object", "properties": {}}},
}


class OpenAIServer:
    """The request handling behind the routes: validation, sampling parameters, response bodies."""

    def __init__(
        self,
        batcher: EngineBatcher,
        tokenizer: Any,
        model_name: str,
        max_context: int | None,
        limits: ServerLimits,
        recorder: EpisodeRecorder | None = None,
        tool_format: str | None = None,
        tools_in_prompt: ToolsInPrompt = "template",
    ) -> None:
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = max_context
        self.limits = limits
        self.recorder = recorder
        self.created = int(time.time())
        self._renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
        drops = self._renderer is not None and not tools_reach_prompt(ChatRenderer(tokenizer, [PROBE_TOOL]))
        self.tooling = Tooling(find_tool_format(tool_format, tokenizer.chat_template), tools_in_prompt, drops)
        ends = self._renderer.end_of_turn_ids() if self._renderer is not None else []
        self.turn_end_ids = set(tokenizer.all_special_ids) | set(ends)  # tokens that end a model's turn

    def chat_renderer(self) -> ChatRenderer:
        if self._renderer is None:
            raise bad_request(
                "this model's tokenizer has no chat template: use /v1/completions, or serve a tokenizer with one",
                "messages",
            )
        return self._renderer

    def turn_text(self, r: Rollout, special: bool) -> str:
        """A response's text less the token that ended the turn, with special tokens or without."""
        ids = r.response_ids
        if r.finish_reason == "stop" and ids and ids[-1] in self.turn_end_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    # -- checking a request ------------------------------------------------------------------------
    def check_request(self, req: SamplingRequest, prompts: int) -> None:
        check_parameters(req)
        if req.model is not None and req.model != self.model_name:
            raise bad_request(
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                "model",
                404,
                "model_not_found",
            )
        if req.n > self.limits.max_n:
            raise bad_request(f"n={req.n} is over this server's limit of {self.limits.max_n} (--max-n)", "n")
        if prompts > self.limits.max_prompts:
            raise bad_request(
                f"{prompts} prompts in one request is over this server's limit of {self.limits.max_prompts} "
                f"(--max-prompts)",
                "prompt",
            )

    def to_prompts(self, items: list[str] | list[list[int]]) -> list[Prompt]:
        prompts = []
        for item in items:
            ids = list(item) if isinstance(item, list) else self.tokenizer(item)["input_ids"]
            if not ids:
                raise bad_request("prompt is empty", "prompt")
            text = item if isinstance(item, str) else self.tokenizer.decode(ids)
            prompts.append(Prompt(text=text, prompt_ids=ids))
        return prompts

    def sampling(
        self, req: SamplingRequest, prompts: list[Prompt], asked: int | None, top: int, field: str
    ) -> SamplingParams:
        """Sampling parameters, with ``max_tokens`` checked against the server's bound and the context
        (unset: what the context leaves, up to the server's default)."""
        longest = max(len(p.prompt_ids) for p in prompts)
        if asked is not None and asked > self.limits.max_tokens:
            raise bad_request(
                f"{field}={asked} is over this server's limit of {self.limits.max_tokens} (--max-tokens-limit)", field
            )
        room = self.limits.max_tokens if self.max_context is None else self.max_context - longest
        if self.max_context is not None and (room <= 0 or (asked is not None and asked > room)):
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                f"{longest + (asked or 1)} tokens ({longest} in the prompt, {asked or 1} for the completion). "
                f"Please reduce the prompt or {field}.",
                field,
                code="context_length_exceeded",
            )
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        return SamplingParams(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            max_tokens=asked or min(self.limits.default_max_tokens, room),
            stop=tuple(stop),
            seed=req.seed,
            top_logprobs=top,
        )

    # -- building answers --------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def completion_logprobs(
        self, tokens: list[int], logprobs: list[float], tops: list | None, k: int, offset: int = 0
    ) -> dict[str, Any]:
        strings = [self.token_text(t) for t in tokens]
        offsets, pos = [], offset
        for text in strings:
            offsets.append(pos)
            pos += len(text)
        top = None
        if k > 0 and tops is not None:
            top = [{self.token_text(t): lp for t, lp in alts[:k]} for alts in tops]
        return {"tokens": strings, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, tokens: list[int], logprobs: list[float], tops: list | None, k: int) -> dict[str, Any]:
        content = []
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            text = self.token_text(t)
            alts = [
                {"token": self.token_text(a), "logprob": alp, "bytes": list(self.token_text(a).encode())}
                for a, alp in (tops[i][:k] if tops is not None and k > 0 else [])
            ]
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alts})
        return {"content": content}

    @staticmethod
    def usage(prompts: list[Prompt], completion: int) -> dict[str, int]:
        prompt_tokens = sum(len(p.prompt_ids) for p in prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def envelope(
        self, prefix: str, kind: str, choices: list[dict], prompts: list[Prompt], rollouts: list[Rollout]
    ) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "weight_version": self.batcher.worker.weight_version,
            "usage": self.usage(prompts, sum(len(r.response_ids) for r in rollouts)),
        }

    # -- the endpoints -----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        raw = req.prompt
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
        self.check_request(req, len(items))
        prompts = self.to_prompts(items)  # type: ignore[arg-type]
        k = req.logprobs
        params = self.sampling(req, prompts, req.max_tokens, k or 0, "max_tokens")
        if req.stream:
            encoder = ChunkEncoder(self, req, prompts, chat=False, k=k)
            new_choice = choice_factory(self, params.stop, req.include_stop_str_in_output, None, chat=False)
            return SSEStream(self, prompts, params, encoder, new_choice).response()
        rollouts = await self.batcher.generate(prompts, params)
        choices = []
        for r, sample in numbered(rollouts):
            lp = self.completion_logprobs(r.response_ids, r.logprobs, r.top_logprobs, k) if k is not None else None
            choices.append(
                {
                    "index": r.prompt_index * params.n + sample,
                    "finish_reason": r.finish_reason,
                    "text": final_text(r, params, req.include_stop_str_in_output),
                    "token_ids": r.response_ids,
                    "logprobs": lp,
                }
            )
        return self.envelope("cmpl", "text_completion", choices, prompts, rollouts)

    async def chat(
        self, req: ChatRequest, x_episode_id: str | None = Header(None, max_length=200)
    ) -> dict[str, Any] | StreamingResponse:
        return await chat_completion(self, req, req.episode_id or x_episode_id)

    async def episode_chat(self, episode: str, req: ChatRequest) -> dict[str, Any] | StreamingResponse:
        """The same call with the episode in the base URL (``{server}/episodes/{id}/v1``): for agents
        and frameworks that can only be pointed at a URL."""
        return await chat_completion(self, req, episode)

    async def responses(
        self, req: ResponsesRequest, x_episode_id: str | None = Header(None, max_length=200)
    ) -> dict[str, Any] | StreamingResponse:
        return await create_response(self, req, req.episode_id or x_episode_id)

    async def episode_responses(self, episode: str, req: ResponsesRequest) -> dict[str, Any] | StreamingResponse:
        return await create_response(self, req, episode)

    async def messages(
        self, req: MessagesRequest, x_episode_id: str | None = Header(None, max_length=200)
    ) -> dict[str, Any] | StreamingResponse:
        return await create_message(self, req, req.episode_id or x_episode_id)

    async def episode_messages(self, episode: str, req: MessagesRequest) -> dict[str, Any] | StreamingResponse:
        return await create_message(self, req, episode)

    async def update_weights(self, req: UpdateWeightsRequest) -> dict[str, Any]:
        if self.limits.weights_dir is None:
            raise bad_request(
                "/update_weights is disabled: start the server with --weights-dir DIR to enable it", "path", 403
            )
        try:
            path = confined_path(self.limits.weights_dir, req.path)
        except ValueError as exc:
            raise bad_request(str(exc), "path", 403) from None
        if not Path(path).is_file():
            raise bad_request(f"no weights file at {req.path}", "path")
        try:
            await self.batcher.update_weights(path, req.version, req.manifest)
        except Exception as exc:  # noqa: BLE001 - a bad file is the client's error; the engine keeps its weights
            raise bad_request(f"could not load {req.path}: {type(exc).__name__}: {exc}", "path") from None
        return {"status": "ok", "weight_version": self.batcher.worker.weight_version}


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
    server = OpenAIServer(batcher, tokenizer, model_name, max_context, limits, recorder, tool_format, tools_in_prompt)
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
            "data": [{"id": model_name, "object": "model", "created": server.created, "owned_by": "postrl"}],
        }

    app.post("/v1/completions", response_model=None)(server.completions)
    app.post("/v1/chat/completions", response_model=None)(server.chat)
    app.post("/v1/responses", response_model=None)(server.responses)
    app.post("/v1/messages", response_model=None)(server.messages)
    app.post("/update_weights")(server.update_weights)
    if recorder is not None:
        app.post("/episodes/{episode}/v1/chat/completions", response_model=None)(server.episode_chat)
        app.post("/episodes/{episode}/v1/responses", response_model=None)(server.episode_responses)
        app.post("/episodes/{episode}/v1/messages", response_model=None)(server.episode_messages)
        add_episode_routes(app, recorder)
    return app
