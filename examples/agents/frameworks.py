"""Tool-using agents written with agent frameworks, trained by postrl unmodified.

Each function is an ``agent.function``: postrl calls it with an ``openai.OpenAI`` client whose base
URL is the episode's own recording URL (``http://127.0.0.1:PORT/episodes/ID/v1``) and a data row;
the agent is built exactly as it would be against any OpenAI-compatible server, pointed at
``str(client.base_url)``, and its return value is the episode's reward. Every call the framework
makes is recorded token for token into the episode, tool calls included.

- ``agents_sdk``: the OpenAI Agents SDK (``openai-agents``), on the Responses API (the SDK's default).
- ``langgraph_react``: LangGraph's prebuilt ReAct agent over LangChain's ``ChatOpenAI``, on chat
  completions with ``tools=``.
"""

from __future__ import annotations

import re
from typing import Any

MODEL = "policy"  # the name the recording server serves
MAX_TOKENS = 96  # per model turn
INSTRUCTIONS = "Solve the arithmetic problem. Use the tools for every sum, difference and product; end with the number."


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract b from a.

    Args:
        a: the number to subtract from
        b: the number to subtract
    """
    return a - b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def reward(text: str | None, row: dict[str, Any]) -> float:
    """1 when the answer's last number is the row's answer."""
    numbers = re.findall(r"-?\d+", text or "")
    return 1.0 if numbers and numbers[-1] == str(row["answer"]) else 0.0


def agents_sdk(client: Any, row: dict[str, Any]) -> float:
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import AgentsException
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would upload traces to OpenAI

    async def run() -> Any:  # the client closed inside its own event loop
        async with AsyncOpenAI(base_url=str(client.base_url), api_key="postrl", max_retries=0) as openai:
            agent = Agent(
                name="calculator",
                instructions=INSTRUCTIONS,
                tools=[function_tool(add), function_tool(subtract), function_tool(multiply)],
                model=OpenAIResponsesModel(MODEL, openai),
                model_settings=ModelSettings(max_tokens=MAX_TOKENS),
            )
            return await Runner.run(agent, row["prompt"], max_turns=4)

    try:
        result = asyncio.run(run())
    except AgentsException:  # out of turns, or a turn cut at max_tokens: the episode earns nothing
        return 0.0
    return reward(result.final_output, row)


def langgraph_react(client: Any, row: dict[str, Any]) -> float:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="postrl", max_retries=0, max_tokens=MAX_TOKENS)
    agent = create_react_agent(llm, [tool(add), tool(subtract), tool(multiply)], prompt=INSTRUCTIONS)
    try:
        state = agent.invoke({"messages": [("user", row["prompt"])]}, {"recursion_limit": 8})
    except GraphRecursionError:
        return 0.0
    return reward(state["messages"][-1].content, row)
