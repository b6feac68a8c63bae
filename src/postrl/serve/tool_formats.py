"""Tool calls in a model family's own text format, as OpenAI's structured ``tool_calls``.

A chat template describes the offered tools (``tools=``) and renders earlier calls in its family's
form; the model writes its calls in that form. Each format here says where a call starts in a
model's text (a stream holds the text back from there), parses a finished turn into content and
calls, and gives the text that starts a turn with a call (``tool_choice: required`` or a named
function: the turn is begun with it, so the model can only go on with a call; no grammar is
needed). A turn whose calls do not parse, or that calls a function it was not offered, is
returned as plain content, never as an error (the caller sees what the model wrote).

- ``hermes`` (Qwen2.5/3, Hermes, SmolLM3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  any number per turn, content around them.
- ``llama3_json`` (Llama 3.1-3.3 with custom tools): the whole turn is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``; several separated by ``;``.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as the OpenAI API carries it
    id: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    content: str | None
    calls: list[ToolCall]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: Any, arguments: Any, offered: set[str]) -> ToolCall | None:
    """A call of an offered function with a JSON-object argument (a JSON string of one is accepted)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or name not in offered or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), call_id())


class ToolCallFormat(ABC):
    name: ClassVar[str]

    @abstractmethod
    def start(self, text: str) -> int | None:
        """Where a call starts in ``text`` (a partial opening at its end counts), or None."""

    @abstractmethod
    def parse(self, text: str, offered: set[str]) -> ParsedTurn | None:
        """A finished turn's content and calls; None when it holds no well-formed call of an offered
        function (the turn is then plain content)."""

    @abstractmethod
    def forced_prefix(self, function: str | None) -> str:
        """The text a turn starts with to be a call (of ``function``, or of one the model names)."""

    def one_call_stops(self) -> tuple[str, ...]:
        """Stop strings that end a turn after its first call (``parallel_tool_calls: false``)."""
        return ()


def _partial_suffix(text: str, marker: str) -> int | None:
    """The start of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return None


class Hermes(ToolCallFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def start(self, text: str) -> int | None:
        at = text.find(self.OPEN)
        return at if at >= 0 else _partial_suffix(text, self.OPEN)

    def parse(self, text: str, offered: set[str]) -> ParsedTurn | None:
        bodies = self._CALL.findall(text)
        if not bodies or text.count(self.OPEN) != len(bodies):
            return None
        calls = []
        for body in bodies:
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return None
            call = _call(obj.get("name"), obj.get("arguments", {}), offered) if isinstance(obj, dict) else None
            if call is None:
                return None
            calls.append(call)
        content = self._CALL.sub("", text).rstrip()  # as streamed: the text before a call, trailing space held
        return ParsedTurn(content if content.strip() else None, calls)

    def one_call_stops(self) -> tuple[str, ...]:
        return (self.CLOSE,)

    def forced_prefix(self, function: str | None) -> str:
        if function is None:
            return f'{self.OPEN}\n{{"name": "'
        return f'{self.OPEN}\n{{"name": {json.dumps(function)}, "arguments": '


class Llama3Json(ToolCallFormat):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        head = text.lstrip()
        if not head or head.startswith(("{", self.TAG)) or self.TAG.startswith(head):
            return 0
        return None

    def parse(self, text: str, offered: set[str]) -> ParsedTurn | None:
        body = text.strip()
        body = body[len(self.TAG) :].strip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return None
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            call = _call(obj.get("name"), args, offered) if isinstance(obj, dict) else None
            if call is None:
                return None
            calls.append(call)
            rest = body[end:].strip()
            if not rest.startswith(";") or not rest[1:].strip():
                if rest not in ("", ";"):
                    return None
                break
            at = len(body) - len(rest[1:].lstrip())
        return ParsedTurn(None, calls)

    def forced_prefix(self, function: str | None) -> str:
        if function is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(function)}, "parameters": '


TOOL_FORMATS: dict[str, type[ToolCallFormat]] = {f.name: f for f in (Hermes, Llama3Json)}


def detect_tool_format(chat_template: str | None) -> str | None:
    """The format a chat template renders calls in, or None when it renders none it knows."""
    template = chat_template or ""
    if Hermes.OPEN in template:
        return Hermes.name
    if Llama3Json.TAG in template or '"parameters": ' in template:
        return Llama3Json.name
    return None


def tool_format(name: str | None, chat_template: str | None) -> ToolCallFormat | None:
    """``name`` (``--tool-format``), or the one the chat template shows (None: neither)."""
    chosen = name or detect_tool_format(chat_template)
    if chosen is None:
        return None
    if chosen not in TOOL_FORMATS:
        raise ValueError(f"unknown tool call format {chosen!r}; known: {', '.join(sorted(TOOL_FORMATS))}")
    return TOOL_FORMATS[chosen]()
