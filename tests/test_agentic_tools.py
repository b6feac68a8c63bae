"""The sandboxed tools of an episode: one jailed interpreter that keeps its state across turns,
restarts (and says so) after a cell that runs too long, and leaves no process or folder behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from postrl.reward.python_session import PythonSession, SessionLost
from postrl.reward.sandbox import SandboxLimits
from postrl.rollout.agentic.env import ToolEnvironment
from postrl.rollout.agentic.env_lookup import environment_factory


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def test_the_python_tool_keeps_state_across_turns_and_leaves_nothing_behind():
    before = descendants()
    env = environment_factory("tools")(tools=["python", "shell"], timeout_s=6.0)
    env.reset({"prompt": "p", "answer": "42", "messages": None})
    first = env.step(
        '<tool_call>{"name": "python", "arguments": {"code": "x = 6\\ndef f(y): return x * y"}}</tool_call>'
    )
    assert first.messages[0]["content"] == "(no output)" and not first.done
    second = env.step('<tool_call>{"name": "python", "arguments": {"code": "f(7)"}}</tool_call>')
    assert second.messages[0]["content"] == "42\n"
    shell = env.step(
        '<tool_call>{"name": "shell", "arguments": {"command": "echo hi > a.txt && cat a.txt && pwd"}}</tool_call>'
    )
    out = shell.messages[0]["content"].splitlines()
    assert out[0] == "hi" and out[1] != os.getcwd()  # in the jail's own working directory
    failing = env.step('<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>')
    assert "ZeroDivisionError" in failing.messages[0]["content"] and failing.tool_calls[0].error is None
    assert env.step("<answer>42</answer>").reward == 1.0
    workdir = env.sandbox.session.workdir
    assert descendants() - before  # the interpreter ran as a child
    env.close()
    time.sleep(0.2)
    assert descendants() - before == set()
    assert workdir is None or not os.path.exists(workdir)


def test_a_cell_past_its_time_limit_restarts_the_interpreter_and_says_its_state_is_gone():
    session = PythonSession(SandboxLimits(wall_s=0.5, cpu_s=30))
    try:
        assert session.run("x = 1") == ("", True)
        with pytest.raises(SessionLost, match="timed out after 0.5 s; the interpreter was restarted"):
            session.run("while True: pass")
        output, ok = session.run("x")
        assert not ok and "NameError" in output
    finally:
        session.close()


def test_a_slow_tool_call_is_answered_with_an_error_and_counted():
    env = ToolEnvironment(["python"], timeout_s=3.0)  # cells get 1 s, the tool call 3 s
    env.reset({"prompt": "p", "answer": "1", "messages": None})
    result = env.step(
        '<tool_call>{"name": "python", "arguments": {"code": "import time\\ntime.sleep(30)"}}</tool_call>'
    )
    assert result.tool_calls[0].error.startswith("SessionLost: timed out after 1 s")
    assert result.messages[0]["content"].startswith("error: SessionLost")
    env.close()


def test_an_unknown_built_in_tool_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown tool 'browser'"):
        ToolEnvironment(["calculator", "browser"])
