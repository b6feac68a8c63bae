"""``POST /v1/responses``: OpenAI's Responses API over the same turn machinery as chat completions.

The request's ``instructions`` and ``input`` items (messages, ``function_call`` and
``function_call_output`` items) become a chat conversation: a ``function_call`` joins the assistant
message before it as one of its tool calls, and its output becomes a tool message, so an agent that
sends the output items back continues a recorded episode's exact tokens. The answer is a
``response`` object whose ``output`` holds a message item (the text) and a ``function_call`` item
per call; ``status`` is ``incomplete`` with reason ``max_output_tokens`` when the turn was cut.
Streaming sends the API's typed events (``response.created`` ... ``response.completed``), the text
as ``response.output_text.delta`` events as it is released. ``previous_response_id`` (a server-side
conversation) is refused: the server keeps no state but the recordings, so send the whole input.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from postrl.serve.chat_completions import Answer, PreparedTurn
from postrl.serve.openai_protocol import ChatRequest, FunctionDefinition, bad_request
from postrl.serve.sse import Delta, sse_event
from postrl.serve.turn_context import TurnContext, add_api_routes

# accepted with no effect on generation
METADATA = (
    "metadata",
    "store",
    "user",
    "service_tier",
    "truncation",
    "include",
    "prompt_cache_key",
    "safety_identifier",
)


class FunctionToolSpec(FunctionDefinition):
    """A Responses API function tool: the chat API's function definition with its ``type`` beside it."""

    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    episode_id: str | None = Field(None, min_length=1, max_length=200)

    def to_chat(self) -> ChatRequest:
        """The same call as a chat-completions request (a bad input item is a 400 naming it)."""
        unknown = sorted(set(self.model_extra or {}) - set(METADATA))
        if unknown:
            raise bad_request(f"parameter '{unknown[0]}' is not supported by /v1/responses", unknown[0])
        if self.previous_response_id is not None:
            raise bad_request(
                "previous_response_id needs server-side state, which this server does not keep: send the whole input",
                "previous_response_id",
            )
        body: dict[str, Any] = {
            "model": self.model,
            "messages": ([{"role": "system", "content": self.instructions}] if self.instructions else [])
            + input_messages(self.input),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_output_tokens,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return ChatRequest.model_validate(body)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: a string or a list of text parts", "input")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content.{i}: a part of type '{kind}' is not supported (only text)", "input")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input.{i}"
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role: one of user, system, developer, assistant", "input")
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                out[-1]["content"] = out[-1]["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue  # the model's reasoning summary: the template renders the turn without it
        else:
            raise bad_request(f"{where}.type: '{kind}' is not supported", "input")
    return out


def output_items(answer: Answer) -> list[dict[str, Any]]:
    """An answer's ``output``: a message item for its text, a function_call item per call."""
    items: list[dict[str, Any]] = []
    message = answer.message
    if message.get("content"):
        text = {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        )
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(call, "completed"))
    return items


def function_call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    f = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{call['id']}",
        "call_id": call["id"],
        "name": f["name"],
        "arguments": f["arguments"],
        "status": status,
    }


def response_object(
    req: ResponsesRequest, rid: str, model: str, output: list, status: str, usage: dict | None
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": _choice(req),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "text": {"format": {"type": "text"}},
        "usage": usage,
        "metadata": {},
    }


def _choice(req: ResponsesRequest) -> Any:
    if isinstance(req.tool_choice, NamedFunctionChoice):
        return req.tool_choice.model_dump()
    return req.tool_choice or "auto"


def _usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponsesEncoder:
    """The Responses API's streamed events for one answer."""

    def __init__(self, req: ResponsesRequest, model: str, prompt_tokens: int) -> None:
        self.req = req
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = f"resp_{uuid.uuid4().hex}"
        self.status = "completed"
        self.seq = 0
        self.text = ""
        self.message_id: str | None = None
        self.output: list[dict[str, Any]] = []

    def _event(self, kind: str, **body: Any) -> str:
        event = sse_event({"type": kind, "sequence_number": self.seq, **body}, kind)
        self.seq += 1
        return event

    def _response(self, status: str, usage: dict | None = None) -> dict[str, Any]:
        return response_object(self.req, self.id, self.model, self.output, status, usage)

    def opening(self, choices: int) -> list[str]:
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def _open_message(self) -> list[str]:
        self.message_id = f"msg_{uuid.uuid4().hex}"
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event(
                "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
            ),
        ]

    def _close_message(self) -> list[str]:
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item = {"type": "message", "id": self.message_id, "status": "completed", "role": "assistant", "content": [part]}
        self.output.append(item)
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_text.done", text=self.text, logprobs=[], **ids),
            self._event("response.content_part.done", part=part, **ids),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def delta(self, d: Delta) -> list[str]:
        events: list[str] = []
        if d.content:
            if self.message_id is None:
                events += self._open_message()
            self.text += d.content
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    delta=d.content,
                    logprobs=[],
                )
            )
        if d.finish is None:
            return events
        if self.message_id is not None:
            events += self._close_message()
        for call in d.tool_calls:
            index, item = len(self.output), function_call_item(call, "in_progress")
            events.append(self._event("response.output_item.added", output_index=index, item={**item, "arguments": ""}))
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
            )
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            done = {**item, "status": "completed"}
            self.output.append(done)
            events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.status = "incomplete" if d.finish == "length" else "completed"
        return events

    def closing(self, completion_tokens: int, error: BaseException | None) -> list[str]:
        if error is not None:
            failed = self._response("failed")
            failed["error"] = {"code": "server_error", "message": f"generation failed: {error}"}
            return [self._event("response.failed", response=failed)]
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [self._event(kind, response=self._response(self.status, _usage(self.prompt_tokens, completion_tokens)))]


async def create_response(
    ctx: TurnContext, req: ResponsesRequest, episode: str | None
) -> dict[str, Any] | StreamingResponse:
    prepared = PreparedTurn.of(ctx, req.to_chat(), episode)
    model = ctx.model_name
    if req.stream:
        return prepared.stream(ResponsesEncoder(req, model, len(prepared.prompt.prompt_ids)))
    (answer,) = await prepared.generate()
    status = "incomplete" if answer.rollout.finish_reason == "length" else "completed"
    usage = _usage(len(prepared.prompt.prompt_ids), len(answer.rollout.response_ids))
    return response_object(req, f"resp_{uuid.uuid4().hex}", model, output_items(answer), status, usage)


def add_responses_routes(app: FastAPI, ctx: TurnContext) -> None:
    """``/v1/responses`` (and, recording, under an episode's base URL)."""
    add_api_routes(app, ctx, "/responses", ResponsesRequest, create_response)
