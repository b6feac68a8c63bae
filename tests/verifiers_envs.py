"""verifiers environments written as a user writes them (``load_environment`` returning a verifiers
Environment), from local rows (``datasets.Dataset.from_list``): a single-turn one, a tool
environment, a multi-turn game, and broken ones for the error paths."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

QUESTIONS = [f"{a}+{b}=" for a in (12, 31, 45, 67) for b in (3, 20)]


def rows(questions: list[str]) -> Dataset:
    return Dataset.from_list([{"question": q, "answer": str(eval(q[:-1])), "info": {"q": q}} for q in questions])


def reply_length(completion) -> float:
    """A reward every reply earns a different share of: how long its last message is, over 100."""
    return len(completion[-1]["content"] or "") / 100


def has_digit(completion) -> float:
    return float(any(ch.isdigit() for ch in completion[-1]["content"] or ""))


def rank_in_group(completions) -> list[float]:
    """A group reward function: each reply's rank by length among its group's, over the group's size."""
    lengths = [len(c[-1]["content"] or "") for c in completions]
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order.index(i) / len(lengths) for i in range(len(lengths))]


def scoring_rubric() -> vf.Rubric:
    return vf.Rubric(funcs=[reply_length, has_digit, rank_in_group], weights=[1.0, 0.0, 0.5])


def load_single_turn(size: int = 8) -> vf.Environment:
    return vf.SingleTurnEnv(
        dataset=rows(QUESTIONS[:size]),
        eval_dataset=rows(["90+9=", "14+41="]),
        system_prompt="Answer with the sum.",
        rubric=scoring_rubric(),
    )


def load_train_only() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=rows(QUESTIONS[:4]), rubric=scoring_rubric())


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def load_tool_env(max_turns: int = 3) -> vf.Environment:
    return vf.ToolEnv(dataset=rows(QUESTIONS[:4]), tools=[add], max_turns=max_turns, rubric=scoring_rubric())


class CountdownGame(vf.MultiTurnEnv):
    """Multi-turn: the environment answers each reply with how many turns are left, until max_turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=f"{self.max_turns - len(state['trajectory'])} left")]


def load_game() -> vf.Environment:
    return CountdownGame(dataset=rows(QUESTIONS[:4]), max_turns=3, rubric=scoring_rubric())


def raising(completion) -> float:
    if "1" in completion[-1]["content"]:
        raise KeyError("no such field")
    return 1.0


def wordy(completion) -> str:
    return "yes"


def load_raising_rubric() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=rows(QUESTIONS[:2]), rubric=vf.Rubric(funcs=[raising]))


def load_wordy_rubric() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=rows(QUESTIONS[:2]), rubric=vf.Rubric(funcs=[wordy]))


def load_broken(rows_file: str = "missing.jsonl") -> vf.Environment:
    raise FileNotFoundError(f"no rows at {rows_file}")


def load_not_an_env() -> dict:
    return {"dataset": []}


def lookup(key: str, table: dict) -> str:
    """Look a key up in the episode's table.

    Args:
        key: the key to look up
    """
    return str(table.get(key, "missing"))


class TableEnv(vf.StatefulToolEnv):
    """A stateful tool environment: the tool's ``table`` argument is hidden from the model and filled
    from the episode's row (its info) at each call."""

    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        self.add_tool(lookup, args_to_skip=["table"])

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        return {**tool_args, "table": state["info"]["table"]}


def load_stateful(max_turns: int = 3) -> vf.Environment:
    data = Dataset.from_list([{"question": "What is x?", "answer": "42", "info": {"table": {"x": 42}}}])
    return TableEnv(dataset=data, max_turns=max_turns, rubric=scoring_rubric())


def load_mcp_env(server: str, token: str) -> vf.Environment:
    """verifiers' own MCPEnv over the tests' MCP stdio server (tests/mcp_servers.py calc: add, lookup)."""
    import sys

    from verifiers.envs.experimental.mcp_env import MCPEnv

    config = {"name": "calc", "command": sys.executable, "args": [server, "calc", token]}
    return MCPEnv(mcp_servers=[config], dataset=rows(QUESTIONS[:2]), max_turns=3, rubric=scoring_rubric())
