"""OpenAI's Responses API and Anthropic's Messages API on ``postrl serve-rollout``, through the real
``openai`` and ``anthropic`` clients: text and tool calls, streamed and not, their stop reasons,
and episodes recorded token-exactly across a call (the second turn's prompt is the first turn's
exact tokens, the model's call as it wrote it, plus the new messages)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.serve.batcher import EngineBatcher
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from tests.chat_templates import family_tokenizer
from tests.scripted_engine import ScriptedEngine
from tests.test_serve import Server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'  # compact: not the template's


@pytest.fixture
def served():
    tokenizer = family_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    batcher = EngineBatcher(engine)
    recorder = EpisodeRecorder(tokenizer)
    server = Server(build_app(batcher, tokenizer, "m", limits=ServerLimits(default_max_tokens=64), recorder=recorder))
    yield engine, tokenizer, server
    server.stop()
    batcher.close()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_one_exact_sample(engine, tokenizer, server, episode: str, generated: list[str]) -> None:
    """The second prompt continues the first context's exact tokens; one sample; the model's
    tokens (with their end-of-turn token) are the trained ones."""
    first = engine.prompts[0] + ids(tokenizer, generated[0]) + [engine.end_id]
    assert engine.prompts[1][: len(first)] == first
    view = httpx.get(f"{server.url}/v1/episodes/{episode}").json()
    assert (len(view["samples"]), view["prefix_breaks"], view["forks"]) == (1, 0, 0)
    assert sum(view["samples"][0]["loss_mask"]) == sum(len(ids(tokenizer, g)) + 1 for g in generated)


def test_responses_api_calls_a_tool_and_continues_the_episode(served):
    engine, tokenizer, server = served
    client = openai.OpenAI(base_url=f"{server.url}/episodes/r1/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": SCHEMA}]
    engine.script = [CALL, "It is sunny in Paris."]
    first = client.responses.create(model="m", instructions="Be brief.", input="Weather in Paris?", tools=tools)
    assert first.status == "completed" and first.output_text == ""
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    follow = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_none=True) for item in first.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]  # fmt: skip
    with client.responses.stream(model="m", instructions="Be brief.", input=follow, tools=tools) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        second = stream.get_final_response()
    assert second.output_text == "It is sunny in Paris." == "".join(deltas) and second.status == "completed"
    assert_one_exact_sample(engine, tokenizer, server, "r1", [CALL, "It is sunny in Paris."])


def test_responses_api_streams_a_call_and_reports_a_cut_answer(served):
    engine, _, server = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    engine.script = [CALL]
    with client.responses.stream(model="m", input="Weather?", tools=tools) as stream:
        done = [e.arguments for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert [json.loads(a) for a in done] == [{"city": "Paris"}]
    assert [(i.type, i.name) for i in final.output] == [("function_call", "get_weather")]
    engine.script = ["A long answer that goes on."]
    cut = client.responses.create(model="m", input="Talk.", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "A lon"
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="m", input="x", previous_response_id="resp_1")


def test_messages_api_calls_a_tool_and_continues_the_episode(served):
    engine, tokenizer, server = served
    client = anthropic.Anthropic(base_url=f"{server.url}/episodes/a1", api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": SCHEMA}]
    engine.script = ["Let me look.\n" + CALL, "Sunny."]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model="m", max_tokens=128, system="Be brief.", messages=messages, tools=tools)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"] and first.content[0].text == "Let me look."
    use = first.content[1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]  # fmt: skip
    with client.messages.stream(model="m", max_tokens=128, system="Be brief.", messages=messages, tools=tools) as s:
        text = "".join(s.text_stream)
        second = s.get_final_message()
    assert text == "Sunny." == second.content[0].text and second.stop_reason == "end_turn"
    assert_one_exact_sample(engine, tokenizer, server, "a1", ["Let me look.\n" + CALL, "Sunny."])


def test_messages_api_stop_reasons_and_a_streamed_call(served):
    engine, _, server = served
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "Count."}]
    engine.script = ["one, two, STOP three"]
    stopped = client.messages.create(model="m", max_tokens=64, messages=ask, stop_sequences=["STOP"])
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == (
        "stop_sequence",
        "STOP",
        "one, two, ",
    )
    engine.script = ["one, two, three"]
    cut = client.messages.create(model="m", max_tokens=4, messages=ask)
    assert (cut.stop_reason, cut.content[0].text, cut.usage.output_tokens) == ("max_tokens", "one,", 4)
    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    engine.script = ['{"city": "Rome"}}\n</tool_call>']
    with client.messages.stream(model="m", max_tokens=64, messages=ask, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:  # fmt: skip
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in final.content] == [
        ("get_weather", {"city": "Rome"})
    ]
    with pytest.raises(anthropic.BadRequestError, match="messages.0.content.0: a user block of type 'image'"):
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])  # fmt: skip
