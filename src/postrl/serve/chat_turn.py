"""One chat-completions call as the chat template sees it, and the model's answer as the API returns it.

:class:`ChatTurn` turns the request's messages into the template's form (an assistant message's
``tool_calls`` with their arguments as objects, as templates render them with ``tojson``; a tool
message with the name of the function it answers), decides what ``tools`` and ``tool_choice`` ask
of the turn (:mod:`postrl.serve.tool_formats`), and turns each generated response into the
assistant message the client gets. The recorder renders the returned message through the same
conversion, so an agent that sends it back continues the episode's exact tokens.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from postrl.rollout.agentic.chat import with_tools_system_message
from postrl.rollout.agentic.tools import parameters_error
from postrl.serve.openai_protocol import ChatRequest, bad_request, cut_at_stop, message_text
from postrl.serve.tool_formats import Hermes, ToolCallFormat

ToolsInPrompt = Literal["template", "system", "none"]


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls as chat templates read them: arguments as an object where they are JSON."""
    out = []
    for call in calls:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (TypeError, json.JSONDecodeError):
            pass  # rendered as the string it is
        out.append({"id": call["id"], "type": "function", "function": function})
    return out


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as the API returns it, in the template's form."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = template_tool_calls(message["tool_calls"])
    return out


def template_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The request's conversation in the template's form; a malformed one is a 400 naming the message."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"messages.{i}.content: a {m.role} message needs content", "messages")
        if m.reasoning_content:
            raise bad_request(
                f"messages.{i}.reasoning_content: this server returns no separate reasoning (it stays in content), "
                "so it takes none back",
                "messages",
            )
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages.{i}.tool_calls: only an assistant message has tool calls", "messages")
        message: dict[str, Any] = {"role": role, "content": message_text(m, i)}
        if m.tool_calls:
            calls = [c.model_dump() for c in m.tool_calls]
            names.update({c["id"]: c["function"]["name"] for c in calls})
            message["tool_calls"] = template_tool_calls(calls)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request(f"messages.{i}.tool_call_id: a tool message names the call it answers", "messages")
            message["tool_call_id"] = m.tool_call_id
            message["name"] = m.name or names.get(m.tool_call_id, "")
        elif m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


@dataclass(frozen=True)
class Tooling:
    """How a server offers tools: ``format``, the family's call format (None: none known);
    ``in_prompt``, where tools are described (``template``: the chat template's ``tools=``;
    ``system``: a system message that asks for the Hermes ``<tool_call>`` form, for templates that
    drop ``tools=``, as SmolLM2's does; ``none``: nowhere, the model knows them)."""

    format: ToolCallFormat | None = None
    in_prompt: ToolsInPrompt = "template"
    template_drops_tools: bool = False


@dataclass(frozen=True)
class ChatTurn:
    """What one call asks of the model's turn."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # as the template reads them
    parser: ToolCallFormat | None = None  # None: the turn is plain content (no tools, or tool_choice none)
    prefix: str = ""  # the text the turn starts with (a forced call)
    extra_stops: tuple[str, ...] = ()  # where the engine stops for this turn (one call only)
    offered: frozenset[str] = field(default_factory=frozenset)
    # the ids of this call's tool calls derive from it and the text, so a streamed turn and its
    # recording, which each parse the text, name each call alike
    salt: str = field(default_factory=lambda: uuid.uuid4().hex)
    sent: list[dict[str, Any]] | None = None  # the request's messages where ``messages`` adds a tools message

    def call_id(self, text: str, index: int) -> str:
        return "call_" + hashlib.sha256(f"{self.salt}:{index}:{text}".encode()).hexdigest()[:24]

    @staticmethod
    def of(req: ChatRequest, tooling: Tooling) -> ChatTurn:
        messages = template_messages(req)
        if not req.tools:
            if req.tool_choice not in (None, "none", "auto"):
                raise bad_request("tool_choice names a tool call but no tools are given", "tool_choice")
            return ChatTurn(messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        offered = frozenset(t.function.name for t in req.tools)
        if len(offered) < len(req.tools):
            raise bad_request("tools: two tools have the same name", "tools")
        for tool in tools:
            function = tool.get("function", {})
            error = parameters_error(function.get("name", "?"), function.get("parameters"))
            if error is not None:
                raise bad_request(f"tools: {error}", "tools")
        rendered: list[dict[str, Any]] | None = tools
        fmt = tooling.format
        sent = None
        if tooling.in_prompt == "system":
            sent, messages, rendered, fmt = messages, with_tools_system_message(messages, tools), None, Hermes()
        elif tooling.in_prompt == "none":
            rendered, fmt = None, fmt or Hermes()
        elif tooling.template_drops_tools:
            raise bad_request(
                "this model's chat template drops tools=, so the model would never see them: start the server with "
                "--tools-in-prompt system (postrl describes them in a system message) or none (the model knows them)",
                "tools",
            )
        choice = req.tool_choice or "auto"
        if choice == "none":
            return ChatTurn(messages, rendered, None, offered=offered, sent=sent)
        if fmt is None:
            raise bad_request(
                "this model's chat template shows no tool call format this server knows; start the server "
                "with --tool-format (hermes, llama3_json), or with --tools-in-prompt system for a template that "
                "drops tools=",
                "tools",
            )
        named = None if isinstance(choice, str) else choice.function.name
        if named is not None and named not in offered:
            raise bad_request(f"tool_choice names '{named}', which is not among the tools", "tool_choice")
        prefix = fmt.forced_prefix(named) if choice != "auto" else ""
        stops = fmt.one_call_stops() if req.parallel_tool_calls is False else ()
        return ChatTurn(messages, rendered, fmt, prefix, stops, offered, sent=sent)

    def reply(self, raw: str, plain: str, user_stops: tuple[str, ...], keep_stop: bool) -> dict[str, Any]:
        """The assistant message for one response. ``raw``: its text with special tokens kept and a
        final stop token left out; ``plain``: as plain content is returned (special tokens skipped).
        A turn offered tools whose calls do not parse comes back as content: the text the model wrote
        (after any forced start of the turn), special tokens kept."""
        if self.parser is None:
            return {"role": "assistant", "content": plain if keep_stop else cut_at_stop(plain, user_stops)[0]}
        text = self.prefix + (raw if keep_stop else cut_at_stop(raw, user_stops)[0])
        parsed = self.parser.parse(text, set(self.offered))
        if parsed is None:
            return {"role": "assistant", "content": text}
        calls = [replace(c, id=self.call_id(text, i)).openai() for i, c in enumerate(parsed.calls)]
        return {"role": "assistant", "content": parsed.content, "tool_calls": calls}
