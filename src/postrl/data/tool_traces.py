"""Tool-calling traces for the warm start of a chat model that has never called a tool (SmolLM2).

Each trace is a conversation as an agent framework drives it through postrl's recording server with
``tools_in_prompt: system``: a system message (the agent's instructions and the offered tools,
written by the server's own code, so the text is the one the model sees at episode time), a user
problem, then one assistant turn per arithmetic step: the expression still to evaluate, then a call
in the Hermes form the server parses (``52*30+504`` and ``<tool_call>{"name": "multiply",
"arguments": {"a": 52, "b": 30}}</tool_call>``, then ``1560+504`` and a call of ``add``), the tool's
answer, and a final assistant turn that states the result. Writing what is left is the model's
scratchpad: it sees which operations remain, and that it is done when one number is left.

The problems are integer expressions with two to four operands (``52*30+504``), worded in a handful
of ways; products first, then left to right, one call per operation, so an expression of k operands
takes k - 1 calls. The tools are described as the OpenAI Agents SDK's ``function_tool`` and
LangChain's ``convert_to_openai_tool`` write them (and as postrl's own ``Tool.from_function``), so the
warm start reads each framework's system message. Nothing here comes from the task libraries: the tasks
the agents are trained on stay unseen.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from postrl.serve.chat_turn import ChatTurn, Tooling
from postrl.serve.openai_protocol import ChatRequest
from postrl.serve.responses_api import ResponsesRequest

Style = Literal["agents_sdk", "langchain", "postrl"]
STYLES: tuple[Style, ...] = ("agents_sdk", "langchain", "postrl")


@dataclass(frozen=True)
class ArithmeticTool:
    name: str
    summary: str
    arguments: tuple[tuple[str, str], tuple[str, str]]  # (name, description) of each integer argument
    symbol: str
    apply: Callable[[int, int], int]

    def spec(self, style: Style) -> dict[str, Any]:
        """The tool as a chat-completions ``tools`` entry, in the shape ``style`` writes it."""
        (a, a_doc), (b, b_doc) = self.arguments
        if style == "langchain":  # the docstring whole, the arguments without descriptions
            doc = f"{self.summary}\n\n    Args:\n        {a}: {a_doc}\n        {b}: {b_doc}"
            props = {a: {"type": "integer"}, b: {"type": "integer"}}
            params: dict[str, Any] = {"properties": props, "required": [a, b], "type": "object"}
            return {"type": "function", "function": {"name": self.name, "description": doc, "parameters": params}}
        if style == "agents_sdk":  # pydantic's schema, strict
            props = {n: {"description": d, "title": n.title(), "type": "integer"} for n, d in ((a, a_doc), (b, b_doc))}
            params = {
                "properties": props,
                "required": [a, b],
                "title": f"{self.name}_args",
                "type": "object",
                "additionalProperties": False,
            }
            return {
                "type": "function",
                "name": self.name,
                "description": self.summary,
                "parameters": params,
                "strict": True,
            }
        props = {n: {"type": "integer", "description": d} for n, d in ((a, a_doc), (b, b_doc))}
        params = {"type": "object", "properties": props, "required": [a, b]}
        return {"type": "function", "function": {"name": self.name, "description": self.summary, "parameters": params}}


TOOLS = {
    t.name: t
    for t in (
        ArithmeticTool(
            "add", "Add two integers.", (("a", "the first addend"), ("b", "the second addend")), "+", int.__add__
        ),
        ArithmeticTool(
            "subtract",
            "Subtract b from a.",
            (("a", "the number to subtract from"), ("b", "the number to subtract")),
            "-",
            int.__sub__,
        ),
        ArithmeticTool(
            "multiply",
            "Multiply two integers.",
            (("a", "the first factor"), ("b", "the second factor")),
            "*",
            int.__mul__,
        ),
    )
}
TOOL_SETS = (("add", "multiply"), ("add", "subtract", "multiply"), ("add", "subtract"), ("multiply", "add"))
INSTRUCTIONS = (
    "Solve the arithmetic problem. Use the tools for every sum, difference and product; end with the number.",
    "Solve the arithmetic problem. Use the tools for sums and products; end with the number.",
    "You are a careful calculator. Compute with the tools, one operation at a time, then give the result.",
    "Answer the question. Call a tool for each arithmetic operation and finish with the final number.",
)
WORDINGS = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e}.",
    "{e} = ?",
    "Work out {e}.",
    "Evaluate {e} and give the number.",
)
FINALS = ("The answer is {n}.", "{e} = {n}", "{n}", "The result is {n}.")


@dataclass(frozen=True)
class Step:
    tool: str
    a: int
    b: int
    result: int
    remaining: str  # the expression still to evaluate when this call is made ("1560+504")


@dataclass(frozen=True)
class Problem:
    expression: str  # as the user sees it: "52*30+504"
    steps: tuple[Step, ...]  # the calls that evaluate it, in order
    answer: int


def _text(values: list[int], ops: list[str]) -> str:
    return str(values[0]) + "".join(f"{s}{n}" for s, n in zip(ops, values[1:], strict=True))


def solve(numbers: list[int], symbols: list[str]) -> Problem:
    """The calls that evaluate ``numbers`` joined by ``symbols`` (``*`` first, then left to right),
    each with the expression left when it is made."""
    by_symbol = {t.symbol: t for t in TOOLS.values()}
    values, ops, steps = list(numbers), list(symbols), []
    for wanted in ("*", None):
        i = 0
        while i < len(ops):
            if wanted is None or ops[i] == wanted:
                tool = by_symbol[ops[i]]
                result = tool.apply(values[i], values[i + 1])
                steps.append(Step(tool.name, values[i], values[i + 1], result, _text(values, ops)))
                values[i : i + 2], ops[i : i + 1] = [result], []
            else:
                i += 1
    return Problem(_text(numbers, symbols), tuple(steps), values[0])


def random_problem(rng: random.Random, tools: tuple[str, ...]) -> Problem:
    symbols_offered = [TOOLS[t].symbol for t in tools]
    count = rng.choice((2, 2, 3, 3, 4))
    symbols = [rng.choice(symbols_offered) for _ in range(count - 1)]
    near_product = [s == "*" for s in symbols]
    numbers = [
        rng.randint(2, 99)
        if (j < len(symbols) and near_product[j]) or (j and near_product[j - 1])
        else rng.randint(2, 999)
        for j in range(count)
    ]
    return solve(numbers, symbols)


def system_messages(instructions: str, tools: tuple[str, ...], style: Style) -> list[dict[str, Any]]:
    """What the recording server renders before the user's turn (``tools_in_prompt: system``), through
    the server's own request models, so the text is the one a framework's request becomes."""
    specs = [TOOLS[t].spec(style) for t in tools]
    tooling = Tooling(None, "system")
    if style == "agents_sdk":
        request = ResponsesRequest.model_validate({"input": "?", "instructions": instructions, "tools": specs})
        chat = request.to_chat()
    else:
        chat = ChatRequest.model_validate(
            {
                "messages": [{"role": "system", "content": instructions}, {"role": "user", "content": "?"}],
                "tools": specs,
            }
        )
    return [m for m in ChatTurn.of(chat, tooling).messages if m["role"] == "system"]


def call_text(step: Step) -> str:
    """One call in the Hermes form :class:`~postrl.serve.tool_formats.Hermes` parses."""
    (a, _), (b, _) = TOOLS[step.tool].arguments
    return "<tool_call>\n" + json.dumps({"name": step.tool, "arguments": {a: step.a, b: step.b}}) + "\n</tool_call>"


def trace(rng: random.Random) -> dict[str, Any]:
    """One conversation (a ``messages`` row for ``postrl sft``) with its problem and answer."""
    tools, style = rng.choice(TOOL_SETS), rng.choice(STYLES)
    problem = random_problem(rng, tools)
    messages = system_messages(rng.choice(INSTRUCTIONS), tools, style)
    messages.append({"role": "user", "content": rng.choice(WORDINGS).format(e=problem.expression)})
    for step in problem.steps:  # the expression left, then the call that reduces it
        messages.append({"role": "assistant", "content": f"{step.remaining}\n{call_text(step)}"})
        messages.append({"role": "tool", "content": str(step.result)})
    final = rng.choice(FINALS).format(e=problem.expression, n=problem.answer)
    messages.append({"role": "assistant", "content": final})
    return {"messages": messages, "answer": str(problem.answer), "style": style}


def write_traces(path: str | Path, count: int, seed: int = 0) -> Path:
    """``count`` traces as JSONL (one ``messages`` row each), the same for the same seed."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps(trace(rng)) + "\n")
    return path
