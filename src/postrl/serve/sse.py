"""Streamed answers (``stream: true``) as server-sent events. Token events from the engine become
each choice's released text and tool calls (:class:`ChoiceStream`: text is released only once it
can no longer change; in a turn offered tools it is held from where a call may start, and the
calls go out when the turn ends, or the held text as content when they do not parse); an
encoder writes them in its API's events (:class:`ChunkEncoder`: OpenAI's chat and completion
chunks; the Responses and Messages encoders live with their endpoints)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import StreamingResponse

from postrl.serve.chat_turn import ChatTurn
from postrl.serve.openai_protocol import SamplingRequest, cut_at_stop
from postrl.serve.turn_context import TurnContext
from postrl.types import Prompt, Rollout, SamplingParams
from postrl.workers.http_guard import detail

# called with the generation's future when it ends (the client may have left before)
OnDone = Callable[["asyncio.Future[list[Rollout]]"], None]


def first_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string found first in ``text``, or None."""
    hits = [(at, s) for s in stops if s and (at := text.find(s)) >= 0]
    return min(hits)[1] if hits else None


@dataclass
class Delta:
    """What one token of a choice releases."""

    index: int
    token: int
    logprob: float
    top: Any
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None  # the engine's finish reason, with the choice's last token
    stop_string: str | None = None  # with the last token: the stop string the choice ended on

    @property
    def empty(self) -> bool:
        return not self.content and not self.tool_calls and self.finish is None


class StreamEncoder(Protocol):
    """One API's events for a streamed answer."""

    def opening(self, choices: int) -> list[str]: ...

    def delta(self, d: Delta) -> list[str]: ...

    def closing(self, completion_tokens: int, error: BaseException | None) -> list[str]: ...


def sse_event(body: dict[str, Any], event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(body)}\n\n"


class ChoiceStream:
    """Incremental text of one streamed choice: releases only text that can no longer change
    (a partly decoded character, or the start of a stop string, is held back)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], keep_stop: bool, ends: set[int]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.keep_stop = keep_stop
        self.ends = ends
        self.hold = 0 if keep_stop else max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""  # text released so far
        self.stop_string: str | None = None  # the stop string the choice ended on

    def turn_tokens(self, finished: bool) -> list[int]:
        """The tokens so far, less the one that ended the turn (``ends``: a chat turn's end tokens)."""
        return self.tokens[:-1] if finished and self.tokens and self.tokens[-1] in self.ends else self.tokens

    def text(self, finished: bool) -> str:
        return self.tokenizer.decode(self.turn_tokens(finished), skip_special_tokens=True)

    def releasable(self, text: str) -> int:
        end = len(text) - self.hold
        return min(end, len(text) - 1) if text.endswith("\ufffd") else end

    def push(self, token: int, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """The text and the tool calls released by ``token`` (none while they may still change)."""
        self.tokens.append(token)
        text = self.text(finished)
        if finished:
            self.stop_string = first_stop(text, self.stops)
            if not self.keep_stop:
                text, _ = cut_at_stop(text, self.stops)
            return self.final(text)
        return self.release(text[: self.releasable(text)]), []

    def release(self, upto: str) -> str:
        if len(upto) <= len(self.sent) or not upto.startswith(self.sent):
            return ""
        delta, self.sent = upto[len(self.sent) :], upto
        return delta

    def final(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self.release(text), []


class ToolChoiceStream(ChoiceStream):
    """A choice of a turn offered tools: special tokens kept (a call's markers may be special
    tokens), text held from where a call may start and trailing whitespace held before it."""

    def __init__(self, tokenizer: Any, turn: ChatTurn, stops: tuple[str, ...], keep_stop: bool, ends: set[int]) -> None:
        super().__init__(tokenizer, stops, keep_stop, ends)
        self.turn = turn

    def text(self, finished: bool) -> str:
        return self.tokenizer.decode(self.turn_tokens(finished), skip_special_tokens=False)

    def releasable(self, text: str) -> int:
        assert self.turn.parser is not None
        end = super().releasable(text)
        start = self.turn.parser.start(self.turn.prefix + text)
        if start is not None:
            end = min(end, start - len(self.turn.prefix))
        return len(text[: max(end, 0)].rstrip())

    def final(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        message = self.turn.reply(text, text, (), keep_stop=True)  # text is already cut at the stops
        return self.release(message["content"] or ""), message.get("tool_calls", [])


class ChunkEncoder:
    """OpenAI's chat (``chat.completion.chunk``) and completion (``text_completion``) chunks."""

    def __init__(
        self, ctx: TurnContext, req: SamplingRequest, prompts: list[Prompt], chat: bool, k: int | None
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.prompts = prompts
        self.chat = chat
        self.k = k
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.offsets: dict[int, int] = {}

    def _chunk(self, choices: list[dict], **extra: Any) -> str:
        body = {
            "id": self.id,
            "object": self.object,
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "choices": choices,
            **extra,
        }
        return sse_event(body)

    def _logprobs(self, d: Delta) -> dict[str, Any] | None:
        if self.k is None:
            return None
        top = [d.top] if d.top else None
        if self.chat:
            return self.ctx.chat_logprobs([d.token], [d.logprob], top, self.k)
        offset = self.offsets.get(d.index, 0)
        self.offsets[d.index] = offset + len(self.ctx.token_text(d.token))
        return self.ctx.completion_logprobs([d.token], [d.logprob], top, self.k, offset)

    def opening(self, choices: int) -> list[str]:
        if not self.chat:
            return []
        role = {"role": "assistant", "content": ""}
        return [
            self._chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}]) for i in range(choices)
        ]

    def delta(self, d: Delta) -> list[str]:
        lp = self._logprobs(d)
        if d.empty and lp is None:
            return []
        if not self.chat:
            return [self._chunk([{"index": d.index, "text": d.content, "logprobs": lp, "finish_reason": d.finish}])]
        delta: dict[str, Any] = {"content": d.content} if d.content else {}
        if d.tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(d.tool_calls)]
        reason = "tool_calls" if d.tool_calls else d.finish
        return [self._chunk([{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": reason}])]

    def closing(self, completion_tokens: int, error: BaseException | None) -> list[str]:
        if error is not None:
            return [sse_event(detail(f"generation failed: {error}")), "data: [DONE]\n\n"]
        usage = []
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            usage = [self._chunk([], usage=self.ctx.usage(self.prompts, completion_tokens))]
        return [*usage, "data: [DONE]\n\n"]


class SSEStream:
    """One streamed answer: the engine's tokens through each choice's stream into the encoder."""

    def __init__(
        self,
        ctx: TurnContext,
        prompts: list[Prompt],
        params: SamplingParams,
        encoder: StreamEncoder,
        new_choice: Callable[[], ChoiceStream],
        on_done: OnDone | None = None,
    ) -> None:
        self.ctx = ctx
        self.prompts = prompts
        self.params = params
        self.encoder = encoder
        self.new_choice = new_choice
        self.on_done = on_done
        self.events: asyncio.Queue = asyncio.Queue()
        self.choices: dict[int, ChoiceStream] = {}

    def response(self) -> StreamingResponse:
        task = asyncio.ensure_future(self.ctx.batcher.generate(self.prompts, self.params, self._on_token))
        task.add_done_callback(lambda _: self.events.put_nowait(None))
        if self.on_done is not None:
            task.add_done_callback(self.on_done)
        return StreamingResponse(
            self._body(task),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    def _on_token(
        self, prompt_index: int, sample: int, token: int, logprob: float, top: Any, finish: str | None
    ) -> None:
        self.events.put_nowait((prompt_index * self.params.n + sample, token, logprob, top, finish))

    async def _body(self, task: asyncio.Future) -> AsyncIterator[str]:
        completion_tokens = 0
        for event in self.encoder.opening(len(self.prompts) * self.params.n):
            yield event
        while (item := await self.events.get()) is not None:
            index, token, logprob, top, finish = item
            completion_tokens += 1
            choice = self.choices.setdefault(index, self.new_choice())
            content, calls = choice.push(token, finish is not None)
            d = Delta(index, token, logprob, top, content, calls, finish, choice.stop_string)
            for event in self.encoder.delta(d):
                yield event
        for event in self.encoder.closing(completion_tokens, task.exception()):
            yield event


def choice_factory(
    ctx: TurnContext, stops: tuple[str, ...], keep: bool, turn: ChatTurn | None, chat: bool
) -> Callable[[], ChoiceStream]:
    """How each choice of a stream is made: a chat turn's ends at its end-of-turn token, and one
    offered tools parses its calls."""
    ends = ctx.turn_end_ids if chat else set()
    if turn is not None and turn.parser is not None:
        parsed = turn
        return lambda: ToolChoiceStream(ctx.tokenizer, parsed, stops, keep, ends)
    return lambda: ChoiceStream(ctx.tokenizer, stops, keep, ends)
