"""Tools every environment can name: ``calculator`` (stateless), ``python`` and ``shell`` (one
sandboxed interpreter per episode)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from postrl.reward.python_session import PythonSession
from postrl.reward.sandbox import SandboxLimits

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 100  # 10**100 is fine; 9**9**9 would hang the process


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "123 * (45 + 6)"
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class SandboxTools:
    """The ``python`` and ``shell`` tools of one episode: one jailed interpreter (the reward
    sandbox's limits and protections), started at the first call, kept across turns, killed with
    its working directory at ``close``.

    Its state is the cells it ran: :meth:`state_dict` saves them and, in a new interpreter (after a
    restart), :meth:`load_state_dict` has them run again before the next call, so variables and
    files come back as far as the cells are deterministic (what used the clock or a random seed
    differs)."""

    def __init__(self, cell_timeout_s: float = 8.0) -> None:
        self.session = PythonSession(SandboxLimits(wall_s=cell_timeout_s, cpu_s=60))
        self.cells: list[str] = []  # every cell run in this episode, in order
        self._replay: list[str] = []  # cells of a restored episode, to run before the next one

    def _run(self, cell: str) -> str:
        for earlier in self._replay:
            self.session.run(earlier)
        self._replay = []
        output, _ = self.session.run(cell)
        self.cells.append(cell)
        return output

    def state_dict(self) -> dict[str, Any]:
        return {"cells": list(self.cells)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cells = list(state["cells"])
        self._replay = list(state["cells"])

    def python(self, code: str) -> str:
        """Run Python code in a persistent interpreter (variables stay between calls); prints and
        the value of a last expression come back.

        Args:
            code: Python statements
        """
        return self._run(code) or "(no output)"

    def shell(self, command: str) -> str:
        """Run a shell command in the sandbox's working directory; stdout and stderr come back.

        Args:
            command: a command line for /bin/sh
        """
        cell = (
            "import subprocess as _sp\n"
            f"_r = _sp.run({command!r}, shell=True, capture_output=True, text=True)\n"
            "print(_r.stdout + _r.stderr + ('' if _r.returncode == 0 else f'(exit status {_r.returncode})'), end='')"
        )
        return self._run(cell) or "(no output)"

    def close(self) -> None:
        self.session.close()


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}
SANDBOX_TOOLS = ("python", "shell")  # methods of SandboxTools: one sandboxed process per episode
