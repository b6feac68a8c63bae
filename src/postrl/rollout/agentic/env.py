"""The environment protocol, its registry, and the built-in tool-use environment.

An environment is a class (or any callable) that makes one object per episode:
``reset(row) -> messages`` gives the first observation (the conversation the model answers),
``step(action) -> StepResult`` takes the model's turn as text and says what comes back (tool
results, a user's reply), with an optional reward and whether the episode is done;
``close()`` frees what the episode holds. ``tools`` are the tools offered through the chat
template. ``agent.env`` names a registered environment or imports ``my_pkg.envs:Maze``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from postrl.rollout.agentic.builtin_tools import BUILTIN_TOOLS, SANDBOX_TOOLS, SandboxTools
from postrl.rollout.agentic.tools import Tool, ToolBox, ToolFormat
from postrl.types.episode import ToolCallRecord


@dataclass
class StepResult:
    messages: list[dict[str, Any]]  # appended to the conversation (empty when done)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)


class Environment(Protocol):
    tools: list[Tool]

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


@runtime_checkable
class SavableEnvironment(Environment, Protocol):
    """An environment whose episode can be saved and restored (across a restart of the process
    that holds it): ``state_dict()`` is JSON-serializable, ``load_state_dict`` replaces ``reset``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


EnvironmentFactory = Callable[..., Environment]
ENVIRONMENTS: dict[str, EnvironmentFactory] = {}


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    def register(factory: EnvironmentFactory) -> EnvironmentFactory:
        if name in ENVIRONMENTS:
            raise ValueError(f"environment '{name}' is already registered")
        ENVIRONMENTS[name] = factory
        return factory

    return register


def first_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's conversation: its ``messages``, or its ``prompt`` as one user message."""
    if row.get("messages"):
        return [dict(m) for m in row["messages"]]
    return [{"role": "user", "content": row["prompt"]}]


_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


class ToolEnvironment:
    """The model may call tools for as many turns as it likes; a turn without a tool call is its
    final answer, rewarded 1 when ``<answer>X</answer>`` matches the row's ``answer`` column."""

    def __init__(self, tools: list[str | Tool], timeout_s: float = 10.0, tool_format: ToolFormat = "auto") -> None:
        names = {t for t in tools if isinstance(t, str)}
        self.sandbox = SandboxTools(cell_timeout_s=max(1.0, timeout_s - 2.0)) if names & set(SANDBOX_TOOLS) else None
        known: dict[str, Callable[..., Any]] = dict(BUILTIN_TOOLS)
        if self.sandbox is not None:
            known |= {"python": self.sandbox.python, "shell": self.sandbox.shell}
        unknown = sorted(n for n in names if n not in known)
        if unknown:
            everything = ", ".join(sorted([*BUILTIN_TOOLS, *SANDBOX_TOOLS]))
            raise ValueError(f"unknown tool '{unknown[0]}' (built in: {everything})")
        self.tools = [t if isinstance(t, Tool) else Tool.from_function(known[t], t) for t in tools]
        self.box = ToolBox(self.tools, timeout_s, tool_format)
        self.answer: str | None = None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.answer = None if row.get("answer") is None else str(row["answer"]).strip()
        return first_messages(row)

    def step(self, action: str) -> StepResult:
        calls = self.box.parse(action)
        if not calls:
            found = _ANSWER.search(action)
            correct = found is not None and self.answer is not None and found.group(1) == self.answer
            return StepResult([], reward=1.0 if correct else 0.0, done=True, info={"answered": found is not None})
        messages, records = [], []
        for call in calls:
            text, record = self.box.call(call)
            messages.append({"role": "tool", "name": call.name or "unknown", "content": text})
            records.append(record)
        return StepResult(messages, tool_calls=records)

    def state_dict(self) -> dict[str, Any]:
        """The episode's answer key and, with python/shell tools, the cells its interpreter ran
        (a restored episode runs them again in its new interpreter before its next call)."""
        return {"answer": self.answer, "sandbox": None if self.sandbox is None else self.sandbox.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.answer = state["answer"]
        if self.sandbox is not None and state.get("sandbox") is not None:
            self.sandbox.load_state_dict(state["sandbox"])

    def close(self) -> None:
        self.box.close()
        if self.sandbox is not None:
            self.sandbox.close()


@register_environment("calculator")
def calculator_environment(**options: Any) -> ToolEnvironment:
    """Arithmetic with a calculator tool (the built-in ``calculator`` task)."""
    return ToolEnvironment(["calculator"], **options)


@register_environment("tools")
def tools_environment(tools: list[str] | None = None, **options: Any) -> ToolEnvironment:
    """Any built-in tools (``env_options: {tools: [python, shell]}``; none given: the calculator;
    ``[]``: none, for a run whose tools all come from ``agent.mcp_servers``), the final answer in
    ``<answer>`` tags checked against the row's ``answer``."""
    return ToolEnvironment(["calculator"] if tools is None else list(tools), **options)
