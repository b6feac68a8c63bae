"""Tools from MCP servers (``agent.mcp_servers``), offered to the model beside an environment's own.

Each server is a stdio subprocess (``command``) or a streamable-HTTP endpoint (``url``), reached
through the official MCP client (the ``mcp`` package). At start every server is started once, its
tools listed and their input schemas checked as postrl's own tools' are (JSON Schema 2020-12; two
servers, or a server and the environment, offering one name is an error naming both); a server
that does not start is a one-line error naming it. ``scope: run`` keeps one session for the whole
run; ``scope: episode`` starts a fresh one for every episode and ends it with the episode.

An episode's environment is wrapped (:class:`McpToolEnvironment`): its tools are the
environment's and the servers'. A model turn that calls a server's tool is answered with the
tools' results as ``tool`` messages (text content, else the structured content as JSON) and the
environment does not see it; every other turn goes to the environment's own ``step``. A tool that
reports an error (``isError``) is answered with that error, like any failing tool. A server that
crashes, or does not answer within ``call_timeout_s``, ends the episode as unscorable
(:class:`McpServerError` out of ``step``), never the run.

The sessions live on one event-loop thread of this process. A stdio server runs under ``setpriv
--pdeathsig KILL`` where the system has it, so that a trainer killed outright takes its servers
with it; a clean end or a Ctrl-C closes them (each within seconds).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import Any

from postrl.config.agent import McpServer
from postrl.rollout.agentic.env import Environment, EnvironmentFactory, StepResult
from postrl.rollout.agentic.tools import Tool, argument_error, checked_tools, parameters_error, parse_tool_calls
from postrl.types.episode import ToolCallRecord
from postrl.workers.process import pdeathsig_prefix

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup
else:  # anyio's dependency on Python 3.10
    from exceptiongroup import BaseExceptionGroup

CLOSE_S = 10.0  # how long closing a session may take before it is abandoned


class McpServerError(RuntimeError):
    """An MCP server that did not start, crashed or did not answer in time. Out of an environment's
    ``step`` it ends the episode as unscorable; at start it names the server that failed."""


class McpLoop:
    """One asyncio event loop on a daemon thread: every MCP session of the process runs on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="postrl-mcp", daemon=True)
        self.thread.start()

    def submit(self, coroutine: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_S)


class McpSession:
    """One open session with one server, held by a task on the loop (MCP's transports must be
    entered and left by the same task)."""

    def __init__(self, server: McpServer, loop: McpLoop) -> None:
        self.server = server
        self.loop = loop
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._listed: Future = Future()
        if server.command is not None and server.command[0] != "python" and shutil.which(server.command[0]) is None:
            raise McpServerError(f"{self.label}: did not start: no program {server.command[0]!r} (agent.mcp_servers)")
        self._held = loop.submit(self._hold())
        try:
            self.listed = self._listed.result(timeout=server.start_timeout_s)
        except FutureTimeout:
            self.close()
            raise McpServerError(f"{self.label}: did not start within {server.start_timeout_s:g} s") from None
        except Exception as exc:
            self.close()
            reason = _reason(exc)
            if reason.startswith(
                ("BrokenResourceError", "ClosedResourceError", "EndOfStream", "McpError: Connection closed")
            ):
                reason = f"it closed its connection before answering ({reason}; its stderr is above)"
            raise McpServerError(f"{self.label}: did not start: {reason}") from None

    @property
    def label(self) -> str:
        return f"MCP server {self.server.name}"

    async def _hold(self) -> None:
        from mcp import ClientSession

        self._stop = asyncio.Event()
        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(_transport(self.server))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                tools, cursor = [], None
                while True:
                    page = await session.list_tools(cursor)
                    tools += page.tools
                    if not (cursor := page.nextCursor):
                        break
                self._session = session
                self._listed.set_result(tools)
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - a failed start is reported to the waiting thread
            if not self._listed.done():
                self._listed.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            elif not isinstance(exc, asyncio.CancelledError | Exception):
                raise

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The server's ``CallToolResult``; McpServerError when it crashed or passed its time limit."""
        from mcp.shared.exceptions import McpError
        from mcp.types import CONNECTION_CLOSED

        limit = self.server.call_timeout_s
        timeout = timedelta(seconds=limit)
        running = self.loop.submit(self._session.call_tool(name, arguments, read_timeout_seconds=timeout))
        try:
            return running.result(timeout=limit + 2.0)
        except FutureTimeout:
            running.cancel()
            raise McpServerError(f"{self.label}: tool {name} did not answer within {limit:g} s") from None
        except McpError as exc:
            if exc.error.code == 408:  # MCP's own read timeout (HTTP's Request Timeout code)
                raise McpServerError(f"{self.label}: tool {name} did not answer within {limit:g} s") from None
            if exc.error.code == CONNECTION_CLOSED:
                raise McpServerError(
                    f"{self.label}: tool {name}: the server closed its connection (it crashed?)"
                ) from None
            raise McpServerError(f"{self.label}: tool {name} failed: {_reason(exc)}") from None
        except Exception as exc:  # the transport: a crashed process, a closed connection
            raise McpServerError(f"{self.label}: tool {name}: {_reason(exc)}") from None

    def close(self) -> None:
        """Ends the session (a stdio server's process with it); one that hangs is abandoned."""
        stop = self._stop
        if stop is not None:
            self.loop.loop.call_soon_threadsafe(stop.set)
        try:
            self._held.result(timeout=CLOSE_S)
        except Exception:  # noqa: BLE001 - a failed or hung session is already reported, or abandoned
            self._held.cancel()


def _transport(server: McpServer) -> Any:
    if server.url is not None:
        from mcp.client.streamable_http import streamable_http_client

        return _two_streams(streamable_http_client(server.url))
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    program, *args = server.command or [""]
    command = [*pdeathsig_prefix(), sys.executable if program == "python" else program, *args]
    return stdio_client(StdioServerParameters(command=command[0], args=command[1:], env=server.env or None))


class _two_streams:  # noqa: N801 - an async context manager, named as the transports are
    """The streamable-HTTP transport's (read, write, session id) as stdio's (read, write)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aenter__(self) -> tuple[Any, Any]:
        read, write, _ = await self.inner.__aenter__()
        return read, write

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.inner.__aexit__(*exc)


def _reason(exc: BaseException) -> str:
    """An exception in one line; an exception group by its first leaf (anyio's task groups wrap)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def tool_text(result: Any) -> str:
    """What the model reads of a ``CallToolResult``: its text content, one part per line (other
    content named by its type), else its structured content as JSON."""
    parts = []
    for item in result.content:
        text = getattr(item, "text", None)  # TextContent; images, audio and resources carry none
        parts.append(text if isinstance(text, str) else f"[{item.type} content]")
    if not [p for p in parts if p] and result.structuredContent is not None:
        return json.dumps(result.structuredContent)
    return "\n".join(parts)


class McpTools:
    """The tools of a run's MCP servers: each server started once at start (its tools listed and
    checked), run-scoped sessions kept until :meth:`close`."""

    def __init__(self, servers: list[McpServer], loop: McpLoop | None = None) -> None:
        self.servers = servers
        self.loop = loop or McpLoop()
        self.shared: dict[str, McpSession] = {}
        self.tools: list[Tool] = []
        self.server_of: dict[str, McpServer] = {}  # tool name -> the server that offers it
        try:
            for server in servers:
                session = McpSession(server, self.loop)
                self._add_tools(server, session.listed)
                if server.scope == "run":
                    self.shared[server.name] = session
                else:  # listed once; each episode starts its own
                    session.close()
            self.validators = checked_tools(self.tools)  # each tool's argument check, made once
        except BaseException:
            self.close()
            raise

    def _add_tools(self, server: McpServer, listed: list[Any]) -> None:
        for tool in listed:
            if tool.name in self.server_of:
                raise ValueError(
                    f"MCP servers {self.server_of[tool.name].name} and {server.name} both offer a tool named "
                    f"{tool.name!r}: tool names must be unique in a run"
                )
            schema = tool.inputSchema or {"type": "object"}
            if (error := parameters_error(tool.name, schema)) is not None:
                raise ValueError(f"MCP server {server.name}: {error}")
            function = {"name": tool.name, "description": tool.description or "", "parameters": schema}
            self.tools.append(Tool(tool.name, _not_in_process(server.name), {"type": "function", "function": function}))
            self.server_of[tool.name] = server

    def episode(self) -> McpEpisodeTools:
        """The sessions of one episode: the run's shared ones, and fresh ones of episode-scoped servers."""
        own = {}
        try:
            for server in self.servers:
                if server.scope == "episode":
                    own[server.name] = McpSession(server, self.loop)
        except BaseException:
            for session in own.values():
                session.close()
            raise
        return McpEpisodeTools(self, {**self.shared, **own}, own)

    def wrapping(self, make_env: EnvironmentFactory) -> EnvironmentFactory:
        """``make_env``, each environment it makes wrapped with these tools (its names checked against them)."""

        def make(**options: Any) -> Environment:
            inner = make_env(**options)
            tools = self.episode()
            try:
                return McpToolEnvironment(inner, tools)
            except BaseException:
                tools.close()
                inner.close()
                raise

        return make

    def close(self) -> None:
        for session in self.shared.values():
            session.close()
        self.shared.clear()
        self.loop.close()


def _not_in_process(server: str) -> Callable[..., Any]:
    def call(**_: Any) -> Any:
        raise RuntimeError(f"a tool of MCP server {server} is called through its session (McpEpisodeTools)")

    return call


class McpEpisodeTools:
    """One episode's view of the servers: its calls go to their sessions; its own sessions (of
    episode-scoped servers) end with :meth:`close`."""

    def __init__(self, tools: McpTools, sessions: dict[str, McpSession], own: dict[str, McpSession]) -> None:
        self.tools = tools
        self.sessions = sessions
        self.own = own

    def call(self, name: str, arguments: dict[str, Any] | None) -> tuple[str, ToolCallRecord]:
        """The text the model reads and the call's record; McpServerError when the server failed."""
        record = ToolCallRecord(name, arguments)
        if (mismatch := argument_error(self.tools.validators[name], arguments)) is not None:
            record.error = f"bad arguments for '{name}': {mismatch}"
            return f"error: {record.error}", record
        result = self.sessions[self.tools.server_of[name].name].call(name, arguments or {})
        text = tool_text(result)
        if result.isError:
            record.error = text or "the tool reported an error"
            return f"error: {record.error}", record
        return text, record

    def close(self) -> None:
        for session in self.own.values():
            session.close()


class McpToolEnvironment:
    """An environment whose model may also call MCP servers' tools: a turn that calls one is
    answered by the servers, every other turn goes to the environment."""

    def __init__(self, inner: Environment, mcp: McpEpisodeTools) -> None:
        own = [t.name for t in inner.tools]
        if clash := sorted(set(own) & set(mcp.tools.server_of)):
            server = mcp.tools.server_of[clash[0]].name
            raise ValueError(f"MCP server {server} offers {clash[0]!r}, which the environment's own tools also name")
        self.inner = inner
        self.mcp = mcp
        self.tools = [*inner.tools, *mcp.tools.tools]
        self.names = {t.name for t in self.tools}

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return self.inner.reset(row)

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action, self.names)
        if not any(c.name in self.mcp.tools.server_of for c in calls):
            return self.inner.step(action)
        messages, records = [], []
        for call in calls:
            if call.error is not None:
                text, record = f"error: {call.error}", ToolCallRecord(call.name, call.arguments, error=call.error)
            elif call.name in self.mcp.tools.server_of:
                text, record = self.mcp.call(call.name, call.arguments)
            else:
                record = ToolCallRecord(call.name, call.arguments)
                record.error = f"'{call.name}' is the environment's tool: call it in a turn without MCP tools"
                text = f"error: {record.error}"
            messages.append({"role": "tool", "name": call.name or "unknown", "content": text})
            records.append(record)
        return StepResult(messages, tool_calls=records)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.mcp.close()
