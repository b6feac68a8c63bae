"""What the API modules of the OpenAI-compatible server share (:class:`TurnContext`): each of
chat completions, the Responses API and the Messages API takes one and registers its own routes;
:func:`postrl.serve.openai_server.build_app` composes them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Header

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.rollout.agentic.template_check import tools_reach_prompt
from postrl.serve.batcher import EngineBatcher
from postrl.serve.chat_turn import Tooling, ToolsInPrompt
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_protocol import SamplingRequest, bad_request, check_parameters
from postrl.serve.tool_formats import tool_format as find_tool_format
from postrl.types import Prompt, Rollout, SamplingParams

PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_7", "parameters": {"type": "object", "properties": {}}},
}


class TurnContext:
    """What every API's handlers share: the engine (through its batcher), the tokenizer and chat
    template, the recorder, the limits; request checks, sampling parameters and response parts."""

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


class EpisodeRequest(Protocol):
    episode_id: str | None  # the episode a call records into (else the X-Episode-Id header's)


Handler = Callable[[TurnContext, Any, "str | None"], Awaitable[Any]]


def add_api_routes(app: FastAPI, ctx: TurnContext, path: str, request: type[EpisodeRequest], handle: Handler) -> None:
    """``/v1{path}``, a body of type ``request`` answered by ``handle(ctx, body, episode)``; with a
    recorder (``ctx.recorder``), also under an episode's base URL ``/episodes/{id}/v1{path}``, for agents
    and frameworks that can only be pointed at a URL."""

    async def plain(req: Any, x_episode_id: str | None = Header(None, max_length=200)) -> Any:
        return await handle(ctx, req, req.episode_id or x_episode_id)

    async def in_episode(episode: str, req: Any) -> Any:
        return await handle(ctx, req, episode)

    for endpoint in (plain, in_episode):
        endpoint.__annotations__["req"] = request  # the body's model (Any above), which FastAPI parses
    app.post(f"/v1{path}", response_model=None)(plain)
    if ctx.recorder is not None:
        app.post(f"/episodes/{{episode}}/v1{path}", response_model=None)(in_episode)
