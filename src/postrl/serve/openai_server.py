"""An OpenAI-compatible HTTP server over a postrl Rollout Worker.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events with
``stream: true``; sampled-token and top-k logprobs; as an extension, the token ids),
``/v1/models``, ``/health`` and ``/update_weights`` (a safetensors path under the weights folder
named at start-up, a version, optionally a checksum manifest). Errors use OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body. Parameters the server does not implement
are refused by name, never ignored. Binds loopback unless told otherwise; see
:class:`ServerLimits` for the bounds on each request and :mod:`postrl.serve.guard` for the token
and body limit.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from postrl.serve.batcher import EngineBatcher
from postrl.serve.guard import BodyLimitMiddleware, TokenMiddleware, confined_path, detail
from postrl.types import Prompt, Rollout, SamplingParams


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for; larger requests get a 400 naming the bound."""

    max_n: int = 64
    max_tokens: int = 4096
    max_prompts: int = 64
    default_max_tokens: int = 256
    weights_dir: str | None = None  # /update_weights reads only files under it; None disables it
    max_body_bytes: int = 4 << 20


# OpenAI parameters this server does not implement, with the values that mean "not used";
# any other value is a 400 naming the parameter.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
# Accepted and without effect on generation: request metadata.
METADATA = ("user", "metadata", "store", "service_tier")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class UpdateWeightsRequest(BaseModel):
    path: str
    version: int = Field(ge=0)
    manifest: dict[str, str] | None = None


def _bad(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> HTTPException:
    return HTTPException(status, {"message": message, "param": param, "code": code})


def check_parameters(req: _Request) -> None:
    """A 400 for any parameter this server does not implement (or does not know), naming it."""
    for name, value in (req.model_extra or {}).items():
        if name in METADATA:
            continue
        if name in NOT_IMPLEMENTED:
            if value in NOT_IMPLEMENTED[name]:
                continue
            raise _bad(f"parameter '{name}' is not supported by this server (got {value!r})", name,
                       code="unsupported_parameter")
        raise _bad(f"unknown parameter '{name}'", name, code="unknown_parameter")


def message_text(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    texts = []
    for i, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise _bad(f"content part {i} of type '{part.type}' is not supported (only text parts)", "messages")
        texts.append(part.text)
    return "\n".join(texts)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class _ChoiceStream:
    """Incremental text of one streamed choice: releases only text that can no longer change
    (a partly decoded character, or the start of a stop string, is held back)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], keep_stop: bool) -> None:
        self.tokenizer, self.stops, self.keep_stop = tokenizer, stops, keep_stop
        self.hold = 0 if keep_stop else max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0  # characters released so far

    def push(self, token: int, finished: bool) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if finished:
            if not self.keep_stop:
                text, _ = cut_at_stop(text, self.stops)
            end = len(text)
        else:
            end = len(text) - self.hold
            if text.endswith("\ufffd"):
                end = min(end, len(text) - 1)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


def build_app(batcher: EngineBatcher, tokenizer: Any, model_name: str, default_max_tokens: int = 256,
              max_context: int | None = None, limits: ServerLimits | None = None, token: str | None = None) -> FastAPI:
    """With ``token``, every request needs ``Authorization: Bearer <token>``."""
    limits = limits or ServerLimits(default_max_tokens=default_max_tokens)
    app = FastAPI(title="postrl rollout server")
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_body_bytes)
    if token:
        app.add_middleware(TokenMiddleware, token=token)
    created = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        info = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            exc.status_code, "invalid_request_error")
        body = {"error": {"message": info["message"], "type": kind, "param": info.get("param"),
                          "code": info.get("code")}, "detail": info["message"]}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors()[:5]:
            where = ".".join(str(p) for p in e["loc"] if p != "body")
            problems.append(f"{where}: {e['msg']}" if where else e["msg"])
        first = next((str(p) for p in exc.errors()[0]["loc"] if p != "body"), None) if exc.errors() else None
        message = "; ".join(problems)
        return JSONResponse({**detail(message), "error": {"message": message, "type": "invalid_request_error",
                                                          "param": first, "code": None}}, status_code=400)

    def check_request(req: _Request, prompts: int) -> None:
        check_parameters(req)
        if req.model is not None and req.model != model_name:
            raise _bad(f"The model '{req.model}' does not exist; this server serves '{model_name}'", "model", 404,
                       "model_not_found")
        if req.n > limits.max_n:
            raise _bad(f"n={req.n} is over this server's limit of {limits.max_n} (--max-n)", "n")
        if prompts > limits.max_prompts:
            raise _bad(f"{prompts} prompts in one request is over this server's limit of {limits.max_prompts} "
                       f"(--max-prompts)", "prompt")

    def to_prompts(items: list[str] | list[list[int]]) -> list[Prompt]:
        prompts = []
        for item in items:
            ids = list(item) if isinstance(item, list) else tokenizer(item)["input_ids"]
            if not ids:
                raise _bad("prompt is empty", "prompt")
            prompts.append(Prompt(text=item if isinstance(item, str) else tokenizer.decode(ids), prompt_ids=ids))
        return prompts

    def sampling(req: _Request, prompts: list[Prompt], asked: int | None, top: int, field: str) -> SamplingParams:
        longest = max(len(p.prompt_ids) for p in prompts)
        if asked is not None and asked > limits.max_tokens:
            raise _bad(f"{field}={asked} is over this server's limit of {limits.max_tokens} (--max-tokens-limit)",
                       field)
        if max_context is not None:
            room = max_context - longest
            if room <= 0 or (asked is not None and asked > room):
                wanted = longest + (asked or 1)
                raise _bad(f"This model's maximum context length is {max_context} tokens. However, you requested "
                           f"{wanted} tokens ({longest} in the prompt, {asked or 1} for the completion). Please "
                           f"reduce the prompt or {field}.", field, code="context_length_exceeded")
        max_tokens = asked or min(limits.default_max_tokens, room if max_context is not None else limits.max_tokens)
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        return SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                              max_tokens=max_tokens, stop=tuple(stop), seed=req.seed, top_logprobs=top)

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def finish_text(r: Rollout, params: SamplingParams, keep_stop: bool) -> str:
        if keep_stop:
            return r.text
        return cut_at_stop(r.text, params.stop)[0]

    def completion_logprobs(tokens: list[int], logprobs: list[float], tops: list | None, k: int,
                            offset: int) -> dict[str, Any]:
        strings = [token_text(t) for t in tokens]
        offsets, pos = [], offset
        for s in strings:
            offsets.append(pos)
            pos += len(s)
        top = None
        if k > 0 and tops is not None:
            top = [{token_text(t): lp for t, lp in alts[:k]} for alts in tops]
        return {"tokens": strings, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(tokens: list[int], logprobs: list[float], tops: list | None, k: int) -> dict[str, Any]:
        content = []
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            s = token_text(t)
            alts = [{"token": token_text(a), "logprob": alp, "bytes": list(token_text(a).encode())}
                    for a, alp in (tops[i][:k] if tops is not None and k > 0 else [])]
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
        return {"content": content}

    def usage(prompts: list[Prompt], completion: int) -> dict[str, int]:
        prompt_tokens = sum(len(p.prompt_ids) for p in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def envelope(prefix: str, kind: str, choices: list[dict], prompts: list[Prompt], rollouts: list[Rollout]) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name,
                "choices": choices, "weight_version": batcher.worker.weight_version,
                "usage": usage(prompts, sum(len(r.response_ids) for r in rollouts))}

    def choice_index(r: Rollout, sample: int, n: int) -> int:
        return r.prompt_index * n + sample

    def numbered(rollouts: list[Rollout]) -> list[tuple[Rollout, int]]:
        seen: dict[int, int] = {}
        out = []
        for r in rollouts:
            out.append((r, seen.get(r.prompt_index, 0)))
            seen[r.prompt_index] = out[-1][1] + 1
        return out

    async def stream(kind: str, req: _Request, prompts: list[Prompt], params: SamplingParams,
                     logprob_k: int | None) -> StreamingResponse:
        """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``."""
        chat = kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        events: asyncio.Queue = asyncio.Queue()
        streams: dict[int, _ChoiceStream] = {}
        offsets: dict[int, int] = {}

        def on_token(prompt_index: int, sample: int, token: int, logprob: float, top: Any, finish: str | None) -> None:
            events.put_nowait((prompt_index * params.n + sample, token, logprob, top, finish))

        task = asyncio.ensure_future(batcher.generate(prompts, params, on_token))
        task.add_done_callback(lambda _: events.put_nowait(None))

        def chunk(choices: list[dict], **extra: Any) -> str:
            body = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": choices,
                    **extra}
            return f"data: {json.dumps(body)}\n\n"

        async def body() -> AsyncIterator[str]:
            completion_tokens = 0
            if chat:
                for i in range(len(prompts) * params.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            while True:
                event = await events.get()
                if event is None:
                    break
                index, token, logprob, top, finish = event
                completion_tokens += 1
                s = streams.setdefault(index, _ChoiceStream(tokenizer, params.stop, req.include_stop_str_in_output))
                text = s.push(token, finish is not None)
                lp = None
                if logprob_k is not None:
                    if chat:
                        lp = chat_logprobs([token], [logprob], [top] if top else None, logprob_k)
                    else:
                        lp = completion_logprobs([token], [logprob], [top] if top else None, logprob_k,
                                                 offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + len(token_text(token))
                if not text and lp is None and finish is None:
                    continue
                if chat:
                    delta = {"content": text} if text else {}
                    yield chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}])
                else:
                    yield chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}])
            error = task.exception()
            if error is not None:
                yield f"data: {json.dumps(detail(f'generation failed: {error}'))}\n\n"
            elif req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], usage=usage(prompts, completion_tokens))
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not batcher.worker.health_check():
            raise HTTPException(503, "engine unhealthy")
        return {"status": "ok", "weight_version": batcher.worker.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "postrl"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        raw = req.prompt
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
        check_request(req, len(items))
        prompts = to_prompts(items)  # type: ignore[arg-type]
        k = req.logprobs
        params = sampling(req, prompts, req.max_tokens, k or 0, "max_tokens")
        if req.stream:
            return await stream("completion", req, prompts, params, k)
        rollouts = await batcher.generate(prompts, params)
        choices = []
        for r, sample in numbered(rollouts):
            text = finish_text(r, params, req.include_stop_str_in_output)
            lp = completion_logprobs(r.response_ids, r.logprobs, r.top_logprobs, k, 0) if k is not None else None
            choices.append({"index": choice_index(r, sample, params.n), "text": text, "finish_reason": r.finish_reason,
                            "token_ids": r.response_ids, "logprobs": lp})
        choices.sort(key=lambda c: c["index"])
        return envelope("cmpl", "text_completion", choices, prompts, rollouts)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatRequest) -> dict[str, Any] | StreamingResponse:
        check_request(req, 1)
        if req.top_logprobs and not req.logprobs:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": message_text(m)}
                    for m in req.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts = to_prompts([tokenizer(text, add_special_tokens=False)["input_ids"]])
        k = (req.top_logprobs or 0) if req.logprobs else None
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = sampling(req, prompts, req.max_completion_tokens or req.max_tokens, k or 0, field)
        if req.stream:
            return await stream("chat", req, prompts, params, k)
        rollouts = await batcher.generate(prompts, params)
        choices = []
        for r, sample in numbered(rollouts):
            lp = chat_logprobs(r.response_ids, r.logprobs, r.top_logprobs, k) if k is not None else None
            choices.append({"index": choice_index(r, sample, params.n),
                            "message": {"role": "assistant",
                                        "content": finish_text(r, params, req.include_stop_str_in_output)},
                            "finish_reason": r.finish_reason, "token_ids": r.response_ids, "logprobs": lp})
        return envelope("chatcmpl", "chat.completion", choices, prompts, rollouts)

    @app.post("/update_weights")
    async def update_weights(req: UpdateWeightsRequest) -> dict[str, Any]:
        if limits.weights_dir is None:
            raise _bad("/update_weights is disabled: start the server with --weights-dir DIR to enable it", "path", 403)
        try:
            path = confined_path(limits.weights_dir, req.path)
        except ValueError as exc:
            raise _bad(str(exc), "path", 403) from None
        if not Path(path).is_file():
            raise _bad(f"no weights file at {req.path}", "path")
        try:
            await batcher.update_weights(path, req.version, req.manifest)
        except Exception as exc:  # noqa: BLE001 - a bad file is the client's error; the engine keeps its weights
            raise _bad(f"could not load {req.path}: {type(exc).__name__}: {exc}", "path") from None
        return {"status": "ok", "weight_version": batcher.worker.weight_version}

    return app
