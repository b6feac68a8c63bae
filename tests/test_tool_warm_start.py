"""The tool-calling warm start of SmolLM2: its traces (hand-checked), the tools described exactly as
the frameworks send them, and the shipped adapter on the real model: a parseable call on a held-out
problem (greedy) and each framework's multi-call episode recorded token-exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from postrl.data.tool_traces import TOOLS, Step, call_text, solve, system_messages, trace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples" / "agents"), str(ROOT / "benchmarks")]
import frameworks  # noqa: E402
from _engine_calls import exactly_engine_calls, log_calls, trained_spans  # noqa: E402

QUESTION = "State the final answer to the following arithmetic problem: 412 + 87 - 39 =\n\nEnd your reply with the final answer as a number."
MULTI = "State the final answer to the following arithmetic problem: 412 + 87 + 39 + 120 =\n\nEnd your reply with the final answer as a number."


def test_a_problem_is_solved_products_first_one_call_per_operation():
    problem = solve([5, 3, 4, 2], ["-", "*", "+"])
    assert problem.expression == "5-3*4+2" and problem.answer == -5
    assert problem.steps == (
        Step("multiply", 3, 4, 12, "5-3*4+2"),
        Step("subtract", 5, 12, -7, "5-12+2"),
        Step("add", -7, 2, -5, "-7+2"),
    )
    assert (
        call_text(problem.steps[0]) == '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    )


def test_a_trace_is_what_the_server_shows_and_what_the_model_should_write():
    import random

    row = trace(random.Random(7))
    roles = [m["role"] for m in row["messages"]]
    calls = roles.count("tool")
    assert roles == ["system", "user", *["assistant", "tool"] * calls, "assistant"] and calls >= 1
    assert "<tools>" in row["messages"][0]["content"]  # the server's tools message (tools_in_prompt: system)
    assert row["messages"][-1]["content"].endswith(row["answer"]) or row["messages"][-1]["content"].endswith(
        row["answer"] + "."
    )


def test_the_tools_are_described_as_the_frameworks_send_them():
    from agents import function_tool
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    for name in ("add", "subtract", "multiply"):
        function = getattr(frameworks, name)
        assert TOOLS[name].spec("langchain") == convert_to_openai_tool(tool(function))
        sdk = function_tool(function)
        spec = TOOLS[name].spec("agents_sdk")
        assert (spec["name"], spec["description"], spec["parameters"], spec["strict"]) == (
            sdk.name,
            sdk.description,
            sdk.params_json_schema,
            sdk.strict_json_schema,
        )


def _smollm2_missing() -> str | None:
    try:
        from postrl.models.gguf import smollm2_gguf_path

        smollm2_gguf_path()
        import gguf  # noqa: F401
        import peft  # noqa: F401
    except (ImportError, FileNotFoundError) as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    missing = _smollm2_missing()
    if missing:
        pytest.skip(f"the offline SmolLM2 is not here: {missing}")
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.models.merge_adapter import merge_adapter

    folder = merge_adapter("smollm2-tools", tmp_path_factory.mktemp("smollm2-tools"))
    return load_causal_lm(str(folder)).eval(), load_tokenizer(str(folder))


@pytest.mark.slow
def test_the_warm_start_calls_a_tool_on_a_held_out_problem(warm_start):
    """A reasoning-gym question it never saw, with the Agents SDK's system message: greedy, its
    first turn is a well-formed call of an offered tool on the first operation."""
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.tool_formats import Hermes
    from postrl.types import Prompt, SamplingParams

    model, tokenizer = warm_start
    messages = system_messages(frameworks.INSTRUCTIONS, ("add", "subtract", "multiply"), "agents_sdk")
    messages.append({"role": "user", "content": QUESTION})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=0)
    (out,) = engine.generate(
        [Prompt(text, tokenizer(text, add_special_tokens=False)["input_ids"])],
        SamplingParams(n=1, temperature=0.0, max_tokens=64),
        None,
    )
    parsed = Hermes().parse(tokenizer.decode(out.response_ids, skip_special_tokens=True), set(TOOLS))
    assert parsed is not None and len(parsed.calls) == 1
    call = parsed.calls[0]
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 412, "b": 87})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["agents_sdk", "langgraph_react"])
def test_each_framework_records_a_multi_call_episode_of_the_warm_start_exactly(warm_start, name):
    """The real model through the framework, unmodified, on a four-term sum (sampled at the
    frameworks' own temperature, 1; seeded engine): several tool calls in one episode, no
    prefix break, and every trained span exactly an engine call's answer to the context before it."""
    from postrl.rollout.agentic.agent_function import RecordedAgents
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.recording_server import RecordingServer
    from postrl.types import Prompt, SamplingParams

    model, tokenizer = warm_start
    engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=0)
    calls = log_calls(engine)
    agents = RecordedAgents(
        RecordingServer.of_engine(engine, tokenizer, tools_in_prompt="system"), getattr(frameworks, name), workers=1
    )
    try:
        rollouts = agents.run([Prompt(MULTI, [], columns={"answer": "658"})], SamplingParams(n=1))
    finally:
        agents.close()
    (rollout,) = rollouts
    episode = rollout.episode
    tool_calls = sum(len(m.get("tool_calls") or []) for m in episode.messages)
    assert tool_calls >= 2 and episode.prefix_breaks == 0 and len(calls) == len(episode.turns) >= 3
    assert exactly_engine_calls(rollout, calls)  # every trained span is an engine call's exact answer
    assert len(trained_spans(rollout)) == len(calls)
