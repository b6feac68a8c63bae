"""An OpenAI-compatible HTTP server over a postrl Rollout Worker.

``/v1/completions`` and ``/v1/chat/completions`` (with sampled-token logprobs and, as an
extension, the token ids), ``/v1/models``, ``/health`` and ``/update_weights`` (a safetensors
path + version, optionally a checksum manifest). This is how an external agent or
environment drives postrl rollouts. Binds loopback unless told otherwise.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from postrl.serve.batcher import EngineBatcher
from postrl.types import Prompt, Rollout, SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=256)
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob is returned")


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)


class UpdateWeightsRequest(BaseModel):
    path: str
    version: int = Field(ge=0)
    manifest: dict[str, str] | None = None


def _params(req: _Request, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return SamplingParams(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        max_tokens=max_tokens or default_max_tokens,
        stop=tuple(stop),
        seed=req.seed,
    )


def _completion_choice(index: int, r: Rollout, tokens: list[str], with_logprobs: bool) -> dict[str, Any]:
    logprobs = {"tokens": tokens, "token_logprobs": r.logprobs, "top_logprobs": None, "text_offset": None}
    return {"index": index, "text": r.text, "finish_reason": r.finish_reason, "token_ids": r.response_ids,
            "logprobs": logprobs if with_logprobs else None}


def _chat_choice(index: int, r: Rollout, tokens: list[str], with_logprobs: bool) -> dict[str, Any]:
    content = [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
               for tok, lp in zip(tokens, r.logprobs)]
    return {"index": index, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason,
            "token_ids": r.response_ids, "logprobs": {"content": content} if with_logprobs else None}


def build_app(batcher: EngineBatcher, tokenizer: Any, model_name: str, default_max_tokens: int = 256,
              max_context: int | None = None) -> FastAPI:
    app = FastAPI(title="postrl rollout server")
    created = int(time.time())

    def to_prompts(items: list[str] | list[list[int]]) -> list[Prompt]:
        prompts = []
        for item in items:
            ids = list(item) if isinstance(item, list) else tokenizer(item)["input_ids"]
            if not ids:
                raise HTTPException(400, "prompt is empty")
            if max_context is not None and len(ids) >= max_context:
                raise HTTPException(400, f"prompt has {len(ids)} tokens; the context limit is {max_context}")
            prompts.append(Prompt(text=item if isinstance(item, str) else tokenizer.decode(ids), prompt_ids=ids))
        return prompts

    def tokens_text(r: Rollout) -> list[str]:
        return [tokenizer.decode([t]) for t in r.response_ids]

    def envelope(prefix: str, kind: str, choices: list[dict], prompts: list[Prompt], rollouts: list[Rollout]) -> dict[str, Any]:
        prompt_tokens = sum(len(p.prompt_ids) for p in prompts)
        completion = sum(len(r.response_ids) for r in rollouts)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name,
                "choices": choices, "weight_version": batcher.worker.weight_version,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not batcher.worker.health_check():
            raise HTTPException(503, "engine unhealthy")
        return {"status": "ok", "weight_version": batcher.worker.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "postrl"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        raw = req.prompt
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
        prompts = to_prompts(items)  # type: ignore[arg-type]
        rollouts = await batcher.generate(prompts, _params(req, req.max_tokens, default_max_tokens))
        choices = [_completion_choice(i, r, tokens_text(r), req.logprobs is not None) for i, r in enumerate(rollouts)]
        return envelope("cmpl", "text_completion", choices, prompts, rollouts)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict[str, Any]:
        text = tokenizer.apply_chat_template([m.model_dump() for m in req.messages], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts = to_prompts([ids])
        rollouts = await batcher.generate(prompts, _params(req, req.max_completion_tokens or req.max_tokens, default_max_tokens))
        choices = [_chat_choice(i, r, tokens_text(r), req.logprobs) for i, r in enumerate(rollouts)]
        return envelope("chatcmpl", "chat.completion", choices, prompts, rollouts)

    @app.post("/update_weights")
    async def update_weights(req: UpdateWeightsRequest) -> dict[str, Any]:
        if not Path(req.path).is_file():
            raise HTTPException(400, f"no weights file at {req.path}")
        try:
            await batcher.update_weights(req.path, req.version, req.manifest)
        except RuntimeError as exc:
            raise HTTPException(409, str(exc)) from None
        return {"status": "ok", "weight_version": batcher.worker.weight_version}

    return app
