"""MCP servers the tests start: ``python tests/mcp_servers.py KIND TOKEN [PORT]``.

TOKEN only marks the process (a test counts the processes whose command line holds it).

- ``calc``: a stdio server written against MCP's low-level API: ``add(a, b)`` answers text,
  ``lookup(key)`` structured content only, ``refuse()`` reports an error (``isError``),
  ``hang()`` never answers, ``crash()`` ends the process mid-call.
- ``stubborn``: ``calc`` that goes on living after its client hangs up (stdin closed), as some
  servers do: only a signal ends it.
- ``other``: a second stdio server that also offers ``add`` (two servers, one name).
- ``badschema``: a stdio server whose one tool's input schema is not a JSON schema.
- ``dies``: exits before it answers ``initialize``.
- ``http``: a FastMCP server on streamable HTTP at ``http://127.0.0.1:PORT/mcp``, tool ``multiply``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import mcp.types as types

NUMBERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
NOTHING = {"type": "object", "properties": {}}


def calc_tools() -> list[types.Tool]:
    key = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
    return [
        types.Tool(name="add", description="Add two integers.", inputSchema=NUMBERS),
        types.Tool(name="lookup", description="Look a key up.", inputSchema=key),
        types.Tool(name="refuse", description="Always fails.", inputSchema=NOTHING),
        types.Tool(name="hang", description="Never answers.", inputSchema=NOTHING),
        types.Tool(name="crash", description="Ends the server.", inputSchema=NOTHING),
    ]


async def call_calc(name: str, arguments: dict) -> types.CallToolResult:
    if name == "add":
        return types.CallToolResult(content=[types.TextContent(type="text", text=str(arguments["a"] + arguments["b"]))])
    if name == "lookup":
        return types.CallToolResult(content=[], structuredContent={"key": arguments["key"], "value": 42})
    if name == "refuse":
        return types.CallToolResult(content=[types.TextContent(type="text", text="no, never")], isError=True)
    if name == "hang":
        await asyncio.sleep(3600)
    os._exit(3)  # crash


async def serve_stdio(tools: list[types.Tool]) -> None:
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    server: Server = Server("postrl-test")

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return tools

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict) -> types.CallToolResult:
        return await call_calc(name, arguments)

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def serve_http(port: int) -> None:
    from mcp.server.fastmcp import FastMCP

    app = FastMCP("postrl-test-http", host="127.0.0.1", port=port, log_level="WARNING")

    @app.tool()
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    app.run(transport="streamable-http")


def main() -> None:
    kind = sys.argv[1]
    if kind == "calc":
        asyncio.run(serve_stdio(calc_tools()))
    elif kind == "stubborn":
        asyncio.run(serve_stdio(calc_tools()))
        time.sleep(3600)
    elif kind == "other":
        asyncio.run(serve_stdio([types.Tool(name="add", description="Add, again.", inputSchema=NUMBERS)]))
    elif kind == "badschema":
        bad = {"type": "object", "properties": {"a": {"type": "not-a-type"}}}
        asyncio.run(serve_stdio([types.Tool(name="broken", description="Bad schema.", inputSchema=bad)]))
    elif kind == "dies":
        sys.exit(1)
    elif kind == "http":
        serve_http(int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown kind {kind}")


if __name__ == "__main__":
    main()
