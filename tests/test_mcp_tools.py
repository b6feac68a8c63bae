"""MCP servers as tool sources (``agent.mcp_servers``): real servers (stdio subprocesses written
against MCP's low-level API, a FastMCP server on streamable HTTP) through the official client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp package is in the test extras (pip install -e '.[test]')")

from postrl.config.agent import EnvAgent, McpServer  # noqa: E402
from postrl.rollout.agentic.env import ToolEnvironment  # noqa: E402
from postrl.rollout.agentic.episode_ops import EpisodeLimits  # noqa: E402
from postrl.rollout.agentic.mcp_tools import McpServerError, McpToolEnvironment, McpTools  # noqa: E402
from postrl.rollout.agentic.tools import Tool  # noqa: E402
from tests.chat_templates import family_tokenizer  # noqa: E402
from tests.test_agentic import run_script  # noqa: E402

SERVERS = Path(__file__).with_name("mcp_servers.py")


def stdio(kind: str, token: str, **fields) -> McpServer:
    return McpServer(name=kind, command=[sys.executable, str(SERVERS), kind, token], **fields)


def processes(token: str) -> list[int]:
    """The live processes whose command line holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if token.encode() in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


def gone(token: str, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while processes(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not processes(token)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


@pytest.fixture
def token() -> str:
    return f"postrl-mcp-test-{uuid.uuid4().hex[:10]}"


def test_a_stdio_server_s_tools_are_listed_checked_and_answer_as_tool_messages(token):
    tools = McpTools([stdio("calc", token)])
    try:
        assert [t.name for t in tools.tools] == ["add", "lookup", "refuse", "hang", "crash"]
        add = tools.tools[0].schema["function"]
        assert add["description"] == "Add two integers." and add["parameters"]["required"] == ["a", "b"]
        assert len(processes(token)) == 1  # scope run: one process, started at start
        env = McpToolEnvironment(ToolEnvironment([]), tools.episode())
        env.reset({"prompt": "2+3?", "answer": "5"})
        step = env.step(f"let me add {call('add', a=2, b=3)} and {call('lookup', key='k')}")
        assert step.messages == [
            {"role": "tool", "name": "add", "content": "5"},
            {"role": "tool", "name": "lookup", "content": '{"key": "k", "value": 42}'},  # structured only: as JSON
        ]
        assert [r.error for r in step.tool_calls] == [None, None] and not step.done
        refused = env.step(call("refuse"))  # the tool's own error: the model reads it, the episode goes on
        assert refused.messages[0]["content"] == "error: no, never" and refused.tool_calls[0].error == "no, never"
        bad = env.step(call("add", a="2", b=3))  # checked against the schema, never sent
        assert bad.tool_calls[0].error.startswith("bad arguments for 'add': a: '2' is not of type 'integer'")
        final = env.step("<answer>5</answer>")  # no MCP call: the environment's own step
        assert final.done and final.reward == 1.0
        env.close()
        assert len(processes(token)) == 1  # the run's session outlives the episode
    finally:
        tools.close()
    assert gone(token)


def test_an_episode_scoped_server_is_started_for_each_episode_and_ended_with_it(token):
    tools = McpTools([stdio("calc", token, scope="episode")])
    try:
        assert processes(token) == []  # listed at start, then ended
        first, second = (McpToolEnvironment(ToolEnvironment([]), tools.episode()) for _ in range(2))
        assert len(processes(token)) == 2
        assert first.step(call("add", a=1, b=1)).messages[0]["content"] == "2"
        first.close()  # its process ends with it; the other episode's goes on
        assert len(processes(token)) == 1
        second.close()
        assert gone(token)
    finally:
        tools.close()


@pytest.mark.parametrize(
    ("tool", "expected"),
    [("hang", "hang did not answer within 1 s"), ("crash", "crash: the server closed its connection (it crashed?)")],
)
def test_a_server_that_hangs_or_crashes_mid_episode_fails_the_episode_not_the_run(token, tool, expected):
    tools = McpTools([stdio("calc", token, scope="episode", call_timeout_s=1)])
    make_env = tools.wrapping(lambda **_: ToolEnvironment([]))
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok.encode(call(tool), add_special_tokens=False) + [end]]
    try:
        began = time.monotonic()
        (rollout,) = run_script(tok, turns, env=make_env, n=1, limits=EpisodeLimits(max_turns=3, env_timeout_s=20))
        assert time.monotonic() - began < 15
        info = rollout.episode.info
        assert rollout.finish_reason == "env_error" and info["env_failed_in"] == "step", info
        assert info["env_reason"].startswith("environment step failed: McpServerError: MCP server calc: tool ")
        assert info["env_reason"].endswith(expected), info["env_reason"]
    finally:
        tools.close()
    assert gone(token)


def test_an_episode_calling_an_mcp_tool_is_the_engine_s_tokens_with_the_tool_result_rendered(token):
    tools = McpTools([stdio("calc", token)])
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [
        tok.encode(call("add", a=20, b=22), add_special_tokens=False) + [end],
        tok.encode("<answer>42</answer>", add_special_tokens=False) + [end],
    ]
    try:
        make_env = tools.wrapping(lambda **_: ToolEnvironment([]))
        (r,) = run_script(tok, turns, env=make_env, n=1, row={"answer": "42"})
    finally:
        tools.close()
    from postrl.rollout.agentic.chat import ChatRenderer

    renderer = ChatRenderer(tok)
    schemas = [t.schema for t in tools.tools]
    first = renderer.render([{"role": "user", "content": "Hi"}], generation_prompt=True, tools=schemas)
    assert r.prompt_ids == renderer.encode(first)  # the servers' tools reach the prompt through the template
    assert '"name": "add"' in first and '"name": "crash"' in first
    assert r.episode.messages[2] == {"role": "tool", "name": "add", "content": "42"}
    assert r.episode.reward == 1.0 and r.finish_reason == "stop"
    assert r.response_ids[: len(turns[0])] == turns[0] and r.response_ids[-len(turns[1]) :] == turns[1]
    delta = r.response_ids[len(turns[0]) : -len(turns[1])]
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(delta)
    assert r.loss_mask == [1] * len(turns[0]) + [0] * len(delta) + [1] * len(turns[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_streamable_http_server_is_reached_by_url(token):
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SERVERS), "http", token, str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        tools = McpTools([McpServer(name="web", url=f"http://127.0.0.1:{port}/mcp")])
        try:
            (multiply,) = tools.tools
            assert multiply.schema["function"]["parameters"]["required"] == ["a", "b"]
            env = McpToolEnvironment(ToolEnvironment([]), tools.episode())
            assert env.step(call("multiply", a=6, b=7)).messages[0]["content"] == "42"
            env.close()
        finally:
            tools.close()
    finally:
        server.terminate()
        server.wait(10)


def test_servers_that_cannot_serve_are_named_at_start(token):
    with pytest.raises(McpServerError, match=r"^MCP server dies: did not start: it closed its connection before"):
        McpTools([stdio("dies", token)])
    missing = McpServer(name="ghost", command=["/no/such/mcp-server"])
    with pytest.raises(McpServerError, match=r"^MCP server ghost: did not start: no program '/no/such/mcp-server'"):
        McpTools([missing])
    with pytest.raises(ValueError, match=r"^MCP server badschema: tool broken: its parameters are not a valid JSON"):
        McpTools([stdio("badschema", token)])
    with pytest.raises(ValueError, match=r"^MCP servers calc and other both offer a tool named 'add'"):
        McpTools([stdio("calc", token), stdio("other", token)])

    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    tools = McpTools([stdio("other", token)])
    try:
        own = ToolEnvironment([Tool.from_function(add)])
        with pytest.raises(ValueError, match=r"MCP server other offers 'add', which the environment's own tools"):
            McpToolEnvironment(own, tools.episode())
    finally:
        tools.close()
    assert gone(token)


def test_the_config_names_what_is_wrong_with_a_server():
    with pytest.raises(ValueError, match="MCP server x: give exactly one of command"):
        McpServer(name="x")
    with pytest.raises(ValueError, match="MCP server x: give exactly one of command"):
        McpServer(name="x", command=["a"], url="http://h/mcp")
    with pytest.raises(ValueError, match="url 'ftp://h' is not an http"):
        McpServer(name="x", url="ftp://h")
    with pytest.raises(ValueError, match="two MCP servers are named 'x'"):
        EnvAgent(env="tools", mcp_servers=[{"name": "x", "command": ["a"]}, {"name": "x", "command": ["b"]}])
    from postrl.config.agent import FunctionAgent

    with pytest.raises(ValueError, match="agent.mcp_servers is not read by an agent.function run"):
        FunctionAgent(function="tests.test_mcp_tools:call", mcp_servers=[{"name": "x", "command": ["a"]}])


RUN = textwrap.dedent(
    """
    model: {{path: {model}}}
    data: {{train_files: [{data}]}}
    output_dir: {out}
    name: mcp
    steps: {steps}
    prompts_per_step: 2
    rollout: {{n: 2, max_tokens: 8}}
    train: {{mini_batch_size: 4, micro_batch_size: 4}}
    checkpoint: {{every_steps: 1}}
    agent:
      env: tools
      env_options: {{tools: []}}
      max_turns: 2
      max_tokens_per_turn: 8
      max_context: 128
      tools_in_prompt: none
      mcp_servers:
        - {{name: calc, command: [{python}, {server}, {kind}, {token}]}}
    """
)


def write_run(
    tmp_path: Path, tiny_model_dir: Path, arithmetic_jsonl: Path, token: str, steps: int, kind: str = "calc"
) -> Path:
    config = tmp_path / "mcp.yaml"
    config.write_text(
        RUN.format(
            model=tiny_model_dir,
            data=arithmetic_jsonl,
            out=tmp_path / "runs",
            steps=steps,
            python=sys.executable,
            server=SERVERS,
            token=token,
            kind=kind,
        )
    )
    return config


def test_postrl_train_with_an_mcp_server_runs_and_leaves_nothing_running(
    tmp_path, tiny_model_dir, arithmetic_jsonl, token
):
    from postrl.cli import main

    assert main(["train", str(write_run(tmp_path, tiny_model_dir, arithmetic_jsonl, token, 2))]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "mcp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert gone(token, 5)


@pytest.mark.slow  # a trainer in a subprocess, stopped mid-run
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_a_stopped_or_killed_trainer_leaves_no_mcp_server(tmp_path, tiny_model_dir, arithmetic_jsonl, token, how):
    from postrl.workers.process import pdeathsig_prefix

    if how == signal.SIGKILL and not pdeathsig_prefix():
        pytest.skip("this system's setpriv has no --pdeathsig: a killed trainer's stdio servers are not taken")
    # a server that outlives its closed stdin: only postrl's close (Ctrl-C) or its death signal (kill) ends it
    config = write_run(tmp_path, tiny_model_dir, arithmetic_jsonl, token, 10_000, kind="stubborn")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "postrl", "train", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = tmp_path / "runs" / "mcp" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            assert trainer.poll() is None, trainer.stderr.read()
            time.sleep(0.2)
        assert len(processes(token)) == 1  # its server, running
        trainer.send_signal(how)
        trainer.wait(60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert gone(token, 10), f"{processes(token)} left after {how.name}"
