"""Matching an agent's request to a recorded episode message by message, through the edits agent
frameworks make to the history they send back.

A framework resends the conversation with every call, and often not as it got it:

- ``trailing_whitespace``: earlier assistant content stripped (LangChain, many templates' clients);
- ``tools_dropped``: the final call sent without ``tools`` (the agent wants an answer, not a call);
- ``arguments_reserialised``: tool-call arguments parsed and dumped again (other spacing, key order);
- ``reasoning_removed``: ``<think>...</think>`` cut from earlier assistant turns (thinking-model clients).

Each such edit changes the rendered text, so the recorder's text prefix no longer matches and the
episode would split. Two messages are the *same* here when they have the same role, the same
content up to surrounding whitespace and reasoning blocks, the same tool calls (names and parsed
arguments) and, for a tool message, the same answer. A request whose messages start with a sample's
recorded messages, message for message in this sense, continues that sample from its exact tokens:
the new messages are rendered after the recorded ones, with the recorded tools.
"""

from __future__ import annotations

import json
import re
from typing import Any

EDITS = ("trailing_whitespace", "tools_dropped", "arguments_reserialised", "reasoning_removed")
_REASONING = re.compile(r"<think>.*?</think>", re.DOTALL)


def without_reasoning(text: str) -> str:
    """``text`` with its ``<think>...</think>`` blocks (and an unclosed one at its end) removed."""
    text = _REASONING.sub("", text)
    at = text.find("<think>")
    return text[:at] if at >= 0 else text


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What must be equal for two messages to be the same one (the module docstring's rule)."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = json.dumps(content, sort_keys=True)
    if message.get("role") == "assistant":
        content = without_reasoning(content)
    calls = tuple(
        (c.get("function", {}).get("name"), json.dumps(_arguments(c), sort_keys=True))
        for c in message.get("tool_calls") or []
    )
    return message.get("role"), content.strip(), calls


def continues(recorded: list[dict[str, Any]], sent: list[dict[str, Any]]) -> bool:
    """Whether ``sent`` is ``recorded`` (message for message, up to the edits) followed by more."""
    return len(sent) > len(recorded) and all(
        message_key(a) == message_key(b) for a, b in zip(recorded, sent, strict=False)
    )


def edits(recorded: list[dict[str, Any]], sent: list[dict[str, Any]]) -> set[str]:
    """Which of :data:`EDITS` but ``tools_dropped`` (the caller sees the tools) turn ``recorded`` into
    the start of ``sent`` (for counting)."""
    found: set[str] = set()
    for a, b in zip(recorded, sent, strict=False):
        if json.dumps(a) == json.dumps(b):  # dicts compare equal whatever their key order; the text does not
            continue
        ca, cb = a.get("content") or "", b.get("content") or ""
        if isinstance(ca, str) and isinstance(cb, str) and ca != cb:
            if without_reasoning(ca) != ca and without_reasoning(cb) == cb:
                found.add("reasoning_removed")
            elif ca.strip() == cb.strip() or without_reasoning(ca).strip() == cb.strip():
                found.add("trailing_whitespace")
        calls_a, calls_b = a.get("tool_calls") or [], b.get("tool_calls") or []
        if [json.dumps(c.get("function", {}).get("arguments")) for c in calls_a] != [
            json.dumps(c.get("function", {}).get("arguments")) for c in calls_b
        ]:  # the text, or the key order of parsed arguments
            found.add("arguments_reserialised")
    return found
