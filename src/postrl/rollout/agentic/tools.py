"""Tools: Python functions offered to the model through the chat template, and its calls to them.

A tool's JSON schema comes from its type hints and docstring (``Args:`` lines describe the
parameters). Calls are parsed from the model's turn in the Hermes/Qwen form
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) or, as a fallback, a line
``name(arg=value, ...)`` naming a known tool. A malformed, unknown, failing or slow call is
answered with an error message to the model and counted, never raised.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from postrl.rollout.agentic.limited import CallTimedOut, LimitedWorker
from postrl.types.episode import ToolCallRecord

ToolFormat = Literal["hermes", "plain", "auto"]
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PLAIN = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # the OpenAI function-tool form the chat template reads

    @staticmethod
    def from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
        name = name or fn.__name__
        hints = typing.get_type_hints(fn)
        doc = inspect.getdoc(fn) or ""
        summary, described = _parse_docstring(doc)
        properties: dict[str, Any] = {}
        required = []
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ValueError(f"tool {name}: *args/**kwargs cannot be described to the model")
            hint = hints.get(pname)
            if hint not in _JSON_TYPES:
                raise ValueError(
                    f"tool {name}: parameter '{pname}' needs a type hint among int, float, str, bool, list, dict"
                )
            properties[pname] = {"type": _JSON_TYPES[hint]}
            if pname in described:
                properties[pname]["description"] = described[pname]
            if param.default is param.empty:
                required.append(pname)
        parameters = {"type": "object", "properties": properties, "required": required}
        schema = {"type": "function", "function": {"name": name, "description": summary, "parameters": parameters}}
        return Tool(name, fn, schema)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The summary (text before ``Args:``) and each ``name: description`` line under ``Args:``."""
    summary, _, args = doc.partition("Args:")
    described = {}
    for line in args.splitlines():
        if ":" in line and line.strip():
            key, _, text = line.strip().partition(":")
            described[key.strip().split(" ")[0]] = text.strip()
    return " ".join(summary.split()), described


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any] | None
    error: str | None = None  # why it could not be parsed


def parse_tool_calls(text: str, known: set[str], fmt: ToolFormat = "auto") -> list[ParsedCall]:
    """Every tool call in a model turn, in order; unparseable ones carry their error."""
    calls: list[ParsedCall] = []
    if fmt in ("hermes", "auto"):
        for body in _HERMES.findall(text):
            calls.append(_parse_hermes(body))
        if calls or fmt == "hermes" or "<tool_call>" in text:
            if "<tool_call>" in text and not calls:
                calls.append(ParsedCall("", None, "malformed tool call: <tool_call> without </tool_call>"))
            return calls
    for name, args in _PLAIN.findall(text):
        if name in known:
            calls.append(_parse_plain(name, args))
    return calls


def _parse_hermes(body: str) -> ParsedCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedCall("", None, f"malformed tool call: not JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ParsedCall("", None, 'malformed tool call: expected {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ParsedCall(call["name"], None, "malformed tool call: arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return ParsedCall(call["name"], None, "malformed tool call: arguments are not a JSON object")
    return ParsedCall(call["name"], arguments)


def _parse_plain(name: str, args: str) -> ParsedCall:
    try:
        node = ast.parse(f"f({args})", mode="eval").body
        assert isinstance(node, ast.Call)
        if node.args:
            raise ValueError("use keyword arguments")
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except (SyntaxError, ValueError) as exc:
        return ParsedCall(name, None, f"malformed tool call: {exc}")
    return ParsedCall(name, arguments)


class ToolBox:
    """The tools of an episode, executed with a time limit. ``call`` never raises: every failure
    becomes the error text the model reads and a counted :class:`ToolCallRecord`."""

    def __init__(self, tools: list[Tool], timeout_s: float = 10.0, fmt: ToolFormat = "auto") -> None:
        self.validators = checked_tools(tools)
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.fmt = fmt
        self.worker = LimitedWorker("postrl-tool")  # one thread: a tool's interpreter lives with it

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def parse(self, text: str) -> list[ParsedCall]:
        return parse_tool_calls(text, set(self.tools), self.fmt)

    def call(self, parsed: ParsedCall) -> tuple[str, ToolCallRecord]:
        """The tool's answer (or the error the model is told) and the record of the call."""
        began = time.perf_counter()
        record = ToolCallRecord(parsed.name, parsed.arguments)
        if parsed.error is not None:
            record.error = parsed.error
        elif parsed.name not in self.tools:
            record.error = f"unknown tool '{parsed.name}' (tools: {', '.join(sorted(self.tools))})"
        elif (mismatch := self.argument_error(parsed.name, parsed.arguments)) is not None:
            record.error = f"bad arguments for '{parsed.name}': {mismatch}"
        else:
            fn, arguments = self.tools[parsed.name].fn, parsed.arguments or {}
            try:
                result = self.worker.call(lambda: fn(**arguments), self.timeout_s, f"tool {parsed.name}")
            except CallTimedOut:
                record.error = f"tool '{parsed.name}' timed out after {self.timeout_s:g} s"
            except TypeError as exc:
                record.error = f"bad arguments for '{parsed.name}': {exc}"
            except Exception as exc:  # the tool's own failure is the model's to read
                record.error = f"{type(exc).__name__}: {exc}"
        record.seconds = time.perf_counter() - began
        if record.error is not None:
            return f"error: {record.error}", record
        return result if isinstance(result, str) else json.dumps(result), record

    def argument_error(self, name: str, arguments: dict[str, Any] | None) -> str | None:
        """Why ``arguments`` do not match the schema tool ``name`` advertises (None: they do)."""
        return argument_error(self.validators[name], arguments)

    def close(self) -> None:
        """Ends the tools' thread (one stuck in a call that timed out was abandoned)."""
        self.worker.close()


def argument_error(validator: jsonschema.protocols.Validator, arguments: dict[str, Any] | None) -> str | None:
    """Why ``arguments`` do not match a tool's schema (None: they do): checked by ``jsonschema``, so
    ``{"a": "2"}`` never reaches ``add(a: int)``."""
    errors = sorted(validator.iter_errors(arguments or {}), key=lambda e: list(e.path))
    if not errors:
        return None
    first = errors[0]
    where = ".".join(str(p) for p in first.path)
    return f"{where}: {first.message}" if where else first.message


def checked_tools(tools: list[Tool]) -> dict[str, jsonschema.protocols.Validator]:
    """The argument checker of each tool, by name; a ValueError naming the tool when two share a
    name or one's ``parameters`` are not a valid JSON schema."""
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two tools share the name {twice[0]!r} (tools: {', '.join(names)})")
    return {t.name: _validator(t) for t in tools}


def parameters_error(name: str, parameters: dict[str, Any] | None) -> str | None:
    """Why a tool's ``parameters`` are not a valid JSON schema (None: they are)."""
    try:
        jsonschema.Draft202012Validator.check_schema(parameters or {"type": "object"})
    except jsonschema.SchemaError as exc:
        return f"tool {name}: its parameters are not a valid JSON schema: {exc.message}"
    return None


def _validator(tool: Tool) -> jsonschema.protocols.Validator:
    """The checker of a tool's ``parameters`` schema (JSON Schema 2020-12); a schema that is itself
    invalid is an error naming the tool, when the tool is made."""
    schema = tool.schema.get("function", {}).get("parameters") or {"type": "object"}
    error = parameters_error(tool.name, schema)
    if error is not None:
        raise ValueError(error)
    return jsonschema.Draft202012Validator(schema)
