"""An MCP server (stdio) that offers one tool, ``calculator``: what ``examples/agents/mcp_tools.yaml``
trains against. Written as any MCP server is, with the official SDK's FastMCP; postrl starts it,
lists its tool, and calls it through the MCP client for every tool call the model makes.

    python examples/agents/mcp_calculator.py      # speaks MCP on stdin/stdout
"""

from mcp.server.fastmcp import FastMCP

from postrl.rollout.agentic.builtin_tools import calculator as evaluate

server = FastMCP("calculator", log_level="WARNING")  # not a line per call on the run's stderr


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "123 * (45 + 6)"
    """
    return evaluate(expression)


if __name__ == "__main__":
    server.run()
