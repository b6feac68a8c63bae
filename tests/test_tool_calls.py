"""OpenAI tools on ``postrl serve-rollout``: calls parsed in the family's format (Hermes/Qwen2.5,
Llama 3.1 JSON) and returned as structured ``tool_calls`` through the real ``openai`` client,
streamed and not; ``tool_choice``; malformed calls as content; recorded episodes that continue
the engine's exact tokens across a call the template formats otherwise than the model wrote it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from postrl.rollout.agentic.recorder import EpisodeRecorder
from postrl.serve.batcher import EngineBatcher
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from postrl.serve.tool_formats import Hermes, Llama3Json
from tests.chat_templates import family_tokenizer
from tests.scripted_engine import ScriptedEngine
from tests.test_serve import Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# -- the formats -------------------------------------------------------------------------------------


def test_hermes_calls_content_and_malformed_turns():
    offered = {"get_weather", "get_time"}
    one = Hermes().parse(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', offered
    )
    assert one.content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in one.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    two = Hermes().parse(
        '<tool_call>{"name":"get_time","arguments":"{}"}</tool_call>\n<tool_call>{"name":"get_weather",'
        '"arguments":{"city":"Oslo"}}</tool_call>',
        offered,
    )
    assert two.content is None and [c.name for c in two.calls] == ["get_time", "get_weather"]
    assert two.calls[0].id != two.calls[1].id and two.calls[0].id.startswith("call_")
    for bad in (
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # not an object
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name"',  # one unclosed
        "no call at all",
    ):
        assert Hermes().parse(bad, offered) is None, bad
    assert Hermes().start("Sure <tool_") == 5 and Hermes().start("Sure <tool_call>{") == 5
    assert Hermes().start("Sure, 3 < 4") is None


def test_llama3_json_calls():
    offered = {"get_weather", "get_time"}
    turn = Llama3Json().parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', offered)
    assert turn.content is None and json.loads(turn.calls[0].arguments) == {"city": "Rome"}
    both = Llama3Json().parse(
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}', offered
    )
    assert [c.name for c in both.calls] == ["get_time", "get_weather"]
    assert Llama3Json().parse('{"name": "get_time", "parameters": {}} and then some prose', offered) is None
    assert Llama3Json().parse("It is sunny.", offered) is None
    assert Llama3Json().start("  ") == 0 and Llama3Json().start("<|pyth") == 0 and Llama3Json().start("It") is None


# -- through the server ------------------------------------------------------------------------------


@pytest.fixture(params=["qwen2.5", "llama3.1-tools"])
def served(request):
    tokenizer = family_tokenizer(request.param)
    end = "<|im_end|>" if request.param == "qwen2.5" else "<|eot_id|>"
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids(end))
    recorder = EpisodeRecorder(tokenizer)
    batcher = EngineBatcher(engine)
    server = Server(build_app(batcher, tokenizer, "m", limits=ServerLimits(default_max_tokens=128), recorder=recorder))
    yield request.param, engine, tokenizer, server, recorder
    server.stop()
    batcher.close()


def call_text(family: str, city: str, compact: bool = False) -> str:
    """A call as the model writes it (``compact``: without the spaces the template puts)."""
    sep = (",", ":") if compact else (", ", ": ")
    if family == "qwen2.5":
        return (
            "<tool_call>\n"
            + json.dumps({"name": "get_weather", "arguments": {"city": city}}, separators=sep)
            + "\n</tool_call>"
        )
    return json.dumps({"name": "get_weather", "parameters": {"city": city}}, separators=sep)


def client_of(server, episode: str | None = None) -> openai.OpenAI:
    base = f"{server.url}/episodes/{episode}/v1" if episode else f"{server.url}/v1"
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


def test_tool_calls_come_back_structured_streamed_or_not(served):
    family, engine, _, server, _ = served
    client = client_of(server)
    engine.script = [call_text(family, "Paris"), call_text(family, "Paris")]
    whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    with client.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER, CLOCK]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    (streamed,) = final.message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_content_before_a_call_streams_and_a_malformed_call_is_content(served):
    family, engine, _, server, _ = served
    client = client_of(server)
    if family == "qwen2.5":
        engine.script = ["Let me check.\n" + call_text(family, "Oslo")] * 2
        chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert text == "Let me check." and [t.function.name for t in calls] == ["get_weather"]
        assert "<tool_call>" not in text  # held back from where the call starts
        whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER]).choices[0]
        assert whole.message.content == "Let me check." and whole.message.tool_calls[0].function.name == "get_weather"
    broken = call_text(family, "Oslo")[:-4]
    engine.script = [broken, broken]
    whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER]).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None and whole.message.content == broken
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == broken


def test_tool_choice_forces_a_call_or_none(served):
    family, engine, tokenizer, server, _ = served
    client = client_of(server)
    full = call_text(family, "Lima")
    prefix = (Hermes() if family == "qwen2.5" else Llama3Json()).forced_prefix("get_weather")
    engine.script = [full[len(prefix) :]]
    named = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]
    assert json.loads(named.message.tool_calls[0].function.arguments) == {"city": "Lima"}
    assert tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith(prefix)  # the turn began with it
    engine.script = [full]
    plain = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none").choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="'nope', which is not among the tools"):
        client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    with pytest.raises(openai.BadRequestError, match="no tools are given"):
        client.chat.completions.create(model="m", messages=ASK, tool_choice="required")


def test_a_conversation_with_calls_and_results_renders_through_the_template(served):
    family, engine, tokenizer, server, _ = served
    client = client_of(server)
    engine.script = ["It is sunny."]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    reply = client.chat.completions.create(model="m", messages=history, tools=[WEATHER]).choices[0]
    assert reply.message.content == "It is sunny." and reply.finish_reason == "stop"
    expected = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}]  # fmt: skip
    text = tokenizer.apply_chat_template(expected, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert engine.prompts[-1] == tokenizer(text, add_special_tokens=False)["input_ids"]
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": [*ASK, {"role": "tool", "content": "x"}]})
    assert bad.status_code == 400 and "messages.1.tool_call_id" in bad.json()["error"]["message"]


def test_a_recorded_episode_continues_the_exact_tokens_across_a_call(served):
    """The model writes its call compactly; the template renders it with spaces. The second call's
    prompt is still the first context's exact tokens plus the new messages' tokens."""
    family, engine, tokenizer, server, recorder = served
    client = client_of(server, "ep1")
    engine.script = [call_text(family, "Paris", compact=True), "Sunny in Paris."]
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER]).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    messages = [
        *ASK,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    with client.chat.completions.stream(model="m", messages=messages, tools=[WEATHER]) as stream:
        second = stream.get_final_completion().choices[0]
    assert second.message.content == "Sunny in Paris."
    generated = tokenizer(call_text(family, "Paris", compact=True), add_special_tokens=False)["input_ids"]
    end = engine.end_id
    assert engine.prompts[1][: len(engine.prompts[0]) + len(generated) + 1] == engine.prompts[0] + generated + [end]
    view = httpx.get(server.url + "/v1/episodes/ep1").json()
    assert (view["prefix_breaks"], view["forks"], len(view["samples"]), view["turns"]) == (0, 0, 1, 2)
    (sample,) = view["samples"]
    context = sample["prompt_ids"] + sample["response_ids"]
    assert context[: len(engine.prompts[1])] == engine.prompts[1]
    mask = sample["loss_mask"]
    n0 = len(engine.prompts[0]) - len(sample["prompt_ids"])
    assert mask[n0 : n0 + len(generated) + 1] == [1] * (len(generated) + 1)  # the model's call, trained
    assert (
        sum(mask) == len(generated) + 1 + len(tokenizer("Sunny in Paris.", add_special_tokens=False)["input_ids"]) + 1
    )
    assert recorder.take("ep1") is not None


def test_n_choices_and_concurrent_calls_fork_samples(served):
    family, engine, _, server, _ = served
    client = client_of(server, "ep2")
    engine.script = ["A one.", "B two."]
    two = client.chat.completions.create(model="m", messages=ASK, n=2)
    assert [c.message.content for c in two.choices] == ["A one.", "B two."]
    engine.script = ["A one.", "B two."]
    chunks = list(client_of(server).chat.completions.create(model="m", messages=ASK, n=2, stream=True))
    for i, text in enumerate(["A one.", "B two."]):  # streamed alike (the end-of-turn token is not content)
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i) == text
        )
    engine.script = ["B three."]
    follow = [*ASK, {"role": "assistant", "content": "B two."}, {"role": "user", "content": "and?"}]
    client.chat.completions.create(model="m", messages=follow)
    view = httpx.get(server.url + "/v1/episodes/ep2").json()
    assert (len(view["samples"]), view["forks"], view["prefix_breaks"]) == (2, 1, 0)
    second = view["samples"][1]  # the fork: the shared prompt, then "B two." and its follow-up, trained
    assert sum(second["loss_mask"]) == len("B two.") + 1 + len("B three.") + 1
    assert sum(view["samples"][0]["loss_mask"]) == len("A one.") + 1


def test_a_concurrent_call_on_a_busy_conversation_forks(served):
    """Two calls of one episode on the same conversation at once (sub-agents, parallel tools): the
    second starts while the first is generating, so it forks a sample from the shared context."""
    family, engine, _, server, _ = served
    engine.script, engine.gate = ["first.", "second."], threading.Event()
    body = {"model": "m", "messages": ASK}
    url = f"{server.url}/episodes/ep3/v1/chat/completions"
    replies: list = []
    first = threading.Thread(target=lambda: replies.append(httpx.post(url, json=body, timeout=30)))
    first.start()
    assert engine.received.wait(timeout=30)  # the first call is in the engine
    second = threading.Thread(target=lambda: replies.append(httpx.post(url, json=body, timeout=30)))
    second.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/v1/episodes/ep3").json()["forks"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # until the second call has its place in the episode
    engine.gate.set()
    first.join(), second.join()
    assert sorted(r.json()["choices"][0]["message"]["content"] for r in replies) == ["first.", "second."]
    view = httpx.get(f"{server.url}/v1/episodes/ep3").json()
    assert (len(view["samples"]), view["forks"], view["prefix_breaks"]) == (2, 1, 0)
    assert [sum(s["loss_mask"]) for s in view["samples"]] == [len("first.") + 1, len("second.") + 1]


def test_the_recording_server_refuses_a_tool_whose_parameters_are_not_a_schema(served):
    _, _, _, server, _ = served
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "objekt"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tools" and "tool lookup: its parameters are not a valid JSON schema" in error["message"]
