"""History that agent frameworks rewrite before sending it back: each edit keeps the episode on the
engine's tokens (one sample, no prefix break), matched message by message; a template that drops
earlier reasoning trains each turn with the context the model saw. Through the real server, with a
scripted engine (what the model writes must be known)."""

from __future__ import annotations

import json

import httpx
import pytest

from postrl.rollout.agentic.history_match import continues, edits, message_key, without_reasoning
from postrl.rollout.agentic.recorder import EpisodeRecorder, calls_in
from postrl.serve.batcher import EngineBatcher
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from tests.chat_templates import QWEN3, family_tokenizer
from tests.scripted_engine import ScriptedEngine
from tests.test_serve import Server

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": SCHEMA}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def serve(family: str, tools_in_prompt: str = "template", template: str | None = None):
    tokenizer = family_tokenizer(family)
    tokenizer.chat_template = template or tokenizer.chat_template
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    batcher = EngineBatcher(engine)
    app = build_app(
        batcher, tokenizer, "m", limits=ServerLimits(default_max_tokens=64), recorder=EpisodeRecorder(tokenizer),
        tools_in_prompt=tools_in_prompt,
    )  # fmt: skip
    return engine, tokenizer, batcher, Server(app)


@pytest.fixture(params=[("qwen2.5", "template"), ("smollm2", "system")], ids=["qwen2.5-tools", "smollm2-system"])
def served(request):
    engine, tokenizer, batcher, server = serve(*request.param)
    engine.family = request.param[0]
    yield engine, tokenizer, server
    server.stop()
    batcher.close()


def chat(server, episode: str, messages: list[dict], tools: list[dict] | None = None) -> dict:
    body = {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    reply = httpx.post(f"{server.url}/episodes/{episode}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def view(server, episode: str) -> dict:
    return httpx.get(f"{server.url}/v1/episodes/{episode}").json()


def as_sent(message: dict) -> dict:
    return {k: v for k, v in message.items() if v is not None}


def edited(message: dict, edit: str) -> dict:
    """The assistant message as a framework sends it back after ``edit``."""
    out = as_sent(message)
    if edit == "trailing_whitespace":
        out["content"] = (out.get("content") or "").rstrip()
    if edit == "reasoning_removed":
        out["content"] = without_reasoning(out["content"]).strip()
    if edit == "arguments_reserialised":
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": json.dumps(dict(reversed(json.loads(c["function"]["arguments"]).items())), separators=(",", ":"))}}
            for c in out["tool_calls"]
        ]  # fmt: skip
    return out


SCRIPTS = {  # what the model writes in its first turn, for each edit
    "trailing_whitespace": "Let me think about it.   \n",
    "reasoning_removed": "<think>2 and 3 make 5</think>It is 5.",
    "arguments_reserialised": CALL,
    "tools_dropped": CALL,
}


@pytest.mark.parametrize("edit", sorted(SCRIPTS))
def test_each_framework_edit_keeps_the_engines_tokens(served, edit):
    engine, tokenizer, server = served
    engine.script = [SCRIPTS[edit], "The answer is 5."]
    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3?"}]
    first = chat(server, edit, messages, TOOLS)
    sent_back = edited(first, edit)
    if first.get("tool_calls"):
        follow = [{"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "5"}]
    else:
        follow = [{"role": "user", "content": "So?"}]
    assert sent_back != as_sent(first) or edit == "tools_dropped"  # the edit changed what is sent
    chat(server, edit, [*messages, sent_back, *follow], None if edit == "tools_dropped" else TOOLS)
    generated = ids(tokenizer, SCRIPTS[edit]) + [engine.end_id]
    assert engine.prompts[1][: len(engine.prompts[0]) + len(generated)] == engine.prompts[0] + generated
    v = view(server, edit)
    assert (len(v["samples"]), v["prefix_breaks"]) == (1, 0)
    unseen = engine.family == "smollm2" and edit == "arguments_reserialised"  # its template writes no calls
    assert v["history_edits"] == ({} if unseen else {edit: 1})
    assert sum(v["samples"][0]["loss_mask"]) == len(generated) + len(ids(tokenizer, "The answer is 5.")) + 1


def test_an_unedited_history_continues_by_text_and_counts_no_edit(served):
    engine, _, server = served
    engine.script = [CALL, "5"]
    messages = [{"role": "user", "content": "2+3?"}]
    first = chat(server, "plain", messages, TOOLS)
    chat(server, "plain", [*messages, as_sent(first), {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "5"}], TOOLS)  # fmt: skip
    v = view(server, "plain")
    assert (len(v["samples"]), v["prefix_breaks"], v["history_edits"]) == (1, 0, {})


def test_the_models_tool_calls_are_counted_on_the_episode():
    """A framework runs the tools itself; the episode still counts the calls the model made
    (``agent/tool_calls``), with their parsed arguments, and a call that parsed to no object as None."""
    tokenizer = family_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    recorder = EpisodeRecorder(tokenizer)
    batcher = EngineBatcher(engine)
    server = Server(build_app(batcher, tokenizer, "m", limits=ServerLimits(default_max_tokens=256), recorder=recorder))
    try:
        engine.script = [CALL + "\n" + CALL.replace('"a": 2', '"a": 7'), "The answer is 5."]
        messages = [{"role": "user", "content": "2+3?"}]
        first = chat(server, "calls", messages, TOOLS)
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "5"} for c in first["tool_calls"]]
        chat(server, "calls", [*messages, as_sent(first), *results], TOOLS)
    finally:
        server.stop()
        batcher.close()
    episode = recorder.take("calls").episode(1.0)
    assert [[(c.name, c.arguments) for c in t.tool_calls] for t in episode.turns] == [
        [("add", {"a": 2, "b": 3}), ("add", {"a": 7, "b": 3})],
        [],
    ]
    assert episode.tool_calls == 2
    assert calls_in({"tool_calls": [{"function": {"name": "add", "arguments": "{not json"}}]})[0].arguments is None


def test_a_changed_message_is_still_a_prefix_break(served):
    """The rule tolerates the named edits only: other content is another conversation."""
    engine, _, server = served
    engine.script = ["It is 5.", "ok"]
    messages = [{"role": "user", "content": "2+3?"}]
    chat(server, "other", messages, TOOLS)
    chat(
        server,
        "other",
        [*messages, {"role": "assistant", "content": "It is 6."}, {"role": "user", "content": "?"}],
        TOOLS,
    )
    v = view(server, "other")
    assert (len(v["samples"]), v["prefix_breaks"], v["history_edits"]) == (2, 1, {})


def test_a_template_that_drops_earlier_reasoning_trains_each_turn_with_what_the_model_saw():
    """Qwen3's template removes <think> blocks before the last user message: the second turn's
    prompt is the template's rendering, a sample of its own (not a break), and every generated
    token is trained once, each with the context the engine was given."""
    # <think> as text, as Qwen3's tokenizer returns it in the content (not a skipped special token)
    engine, tokenizer, batcher, server = serve("qwen2.5", template=QWEN3)
    try:
        engine.script = ["<think>2 and 3 make 5</think>It is 5.", "<think>and 1 is 6</think>6."]
        messages = [{"role": "user", "content": "2+3?"}]
        first = chat(server, "q3", messages)
        chat(server, "q3", [*messages, as_sent(first), {"role": "user", "content": "and +1?"}])
        v = view(server, "q3")
        assert (len(v["samples"]), v["prefix_breaks"], v["history_edits"]) == (2, 0, {"reasoning_split": 1})
        second = v["samples"][1]
        assert second["prompt_ids"] == engine.prompts[1]  # trained with exactly what the model saw
        assert "2 and 3" not in tokenizer.decode(second["prompt_ids"])  # the template dropped the reasoning
        trained = [sum(s["loss_mask"]) for s in v["samples"]]
        assert trained == [
            len(ids(tokenizer, t)) + 1 for t in ("<think>2 and 3 make 5</think>It is 5.", "<think>and 1 is 6</think>6.")
        ]
    finally:
        server.stop()
        batcher.close()


def test_message_keys_tolerate_exactly_the_named_edits():
    call = {"function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    recorded = {"role": "assistant", "content": "<think>x</think>Hi  ", "tool_calls": [call]}
    resent = {
        "role": "assistant",
        "content": "Hi",
        "tool_calls": [{"function": {"name": "add", "arguments": '{"b":3,"a":2}'}}],
    }
    assert message_key(recorded) == message_key(resent)
    assert message_key(recorded) != message_key({**resent, "content": "Hello"})
    assert message_key(recorded) != message_key(
        {**resent, "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}]}
    )
    user = [{"role": "user", "content": "q"}]
    assert continues(user + [recorded], user + [resent, {"role": "tool", "content": "5"}])
    assert not continues(user + [recorded], user + [resent])  # nothing new: not a continuation
    assert edits(user + [recorded], user + [resent]) == {"reasoning_removed", "arguments_reserialised"}
