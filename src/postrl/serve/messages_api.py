"""``POST /v1/messages``: Anthropic's Messages API over the same turn machinery as chat completions.

``system`` and the content blocks of ``messages`` become a chat conversation: an assistant's
``text`` and ``tool_use`` blocks one assistant message with tool calls, a user's ``tool_result``
blocks tool messages (before the user's text), so an agent that sends the blocks back continues a
recorded episode's exact tokens. The answer is a ``message`` with ``text`` and ``tool_use`` blocks
and a ``stop_reason``: ``tool_use``, ``max_tokens``, ``stop_sequence`` (with the sequence) or
``end_turn``. Streaming sends the API's events (``message_start``, ``content_block_start``/``_delta``/
``_stop``, ``message_delta``, ``message_stop``), the text as ``text_delta``s as it is released and
each call's input as one ``input_json_delta``. Anthropic's ``tool_choice`` ``any`` is OpenAI's
``required``; ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from postrl.serve.chat_completions import Answer, PreparedTurn
from postrl.serve.openai_protocol import ChatRequest, bad_request
from postrl.serve.sse import Delta, sse_event
from postrl.serve.turn_context import TurnContext, add_api_routes


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    episode_id: str | None = Field(None, min_length=1, max_length=200)

    def to_chat(self) -> ChatRequest:
        system = _text(self.system, "system") if self.system is not None else None
        body: dict[str, Any] = {
            "model": self.model,
            "messages": ([{"role": "system", "content": system}] if system else []) + chat_messages(self.messages),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
        }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise bad_request("tool_choice.name: a tool choice of type 'tool' names the tool", "tool_choice")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return ChatRequest.model_validate(body)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content or []):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{where}.{i}: a block of type '{kind}' is not supported here (only text)", where)
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages API messages as chat messages (tool results first in a user turn, as they answer
    the calls before it)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role, content, where = m.get("role"), m.get("content"), f"messages.{i}"
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: user or assistant", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content: a string or a list of content blocks", "messages")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {
                            "name": block.get("name"),
                            "arguments": json.dumps(block.get("input", {}), ensure_ascii=False),
                        },
                    }
                )
            elif kind == "tool_result" and role == "user":
                body = block.get("content", "")
                text = body if isinstance(body, str) else _text(body, f"{where}.content.{j}.content")
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # the template renders the turn without it
            else:
                raise bad_request(f"{where}.content.{j}: a {role} block of type '{kind}' is not supported", "messages")
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls or None})
            continue
        out += results
        if texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def content_blocks(answer: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.message.get("content"):
        blocks.append({"type": "text", "text": answer.message["content"]})
    for call in answer.message.get("tool_calls") or []:
        blocks.append(tool_use_block(call))
    return blocks


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }


def stop_reason(finish: str, tool_calls: bool, stop_string: str | None) -> tuple[str, str | None]:
    if tool_calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    return ("stop_sequence", stop_string) if stop_string is not None else ("end_turn", None)


def _message(mid: str, model: str, content: list, reason: tuple[str | None, str | None], usage: dict) -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


class MessagesEncoder:
    """The Messages API's streamed events for one answer."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks = 0  # content blocks opened
        self.text_open = False
        self.reason: tuple[str, str | None] = ("end_turn", None)

    def opening(self, choices: int) -> list[str]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        start = _message(self.id, self.model, [], (None, None), usage)
        return [sse_event({"type": "message_start", "message": start}, "message_start")]

    def _block(self, block: dict[str, Any]) -> str:
        self.blocks += 1
        return sse_event(
            {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}, "content_block_start"
        )

    def _stop(self) -> str:
        return sse_event({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop")

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event(
            {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}, "content_block_delta"
        )

    def delta(self, d: Delta) -> list[str]:
        events: list[str] = []
        if d.content:
            if not self.text_open:
                events.append(self._block({"type": "text", "text": ""}))
                self.text_open = True
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        if d.finish is None:
            return events
        if self.text_open:
            events.append(self._stop())
        for call in d.tool_calls:
            block = tool_use_block(call)
            events.append(self._block({**block, "input": {}}))
            events.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
            events.append(self._stop())
        self.reason = stop_reason(d.finish, bool(d.tool_calls), d.stop_string)
        return events

    def closing(self, completion_tokens: int, error: BaseException | None) -> list[str]:
        if error is not None:
            body = {"type": "error", "error": {"type": "api_error", "message": f"generation failed: {error}"}}
            return [sse_event(body, "error")]
        delta = {"stop_reason": self.reason[0], "stop_sequence": self.reason[1]}
        return [
            sse_event(
                {"type": "message_delta", "delta": delta, "usage": {"output_tokens": completion_tokens}},
                "message_delta",
            ),
            sse_event({"type": "message_stop"}, "message_stop"),
        ]


async def create_message(ctx: TurnContext, req: MessagesRequest, episode: str | None) -> dict | StreamingResponse:
    prepared = PreparedTurn.of(ctx, req.to_chat(), episode)
    prompt_tokens = len(prepared.prompt.prompt_ids)
    if req.stream:
        return prepared.stream(MessagesEncoder(ctx.model_name, prompt_tokens))
    (answer,) = await prepared.generate()
    r = answer.rollout
    reason = stop_reason(r.finish_reason, bool(answer.message.get("tool_calls")), answer.stop_string)
    usage = {"input_tokens": prompt_tokens, "output_tokens": len(r.response_ids)}
    return _message(f"msg_{uuid.uuid4().hex}", ctx.model_name, content_blocks(answer), reason, usage)


def add_messages_routes(app: FastAPI, ctx: TurnContext) -> None:
    """``/v1/messages`` (and, recording, under an episode's base URL, to which an Anthropic client adds ``/v1``)."""
    add_api_routes(app, ctx, "/messages", MessagesRequest, create_message)
