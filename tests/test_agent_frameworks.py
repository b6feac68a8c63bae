"""Agents written with agent frameworks nobody here wrote (the OpenAI Agents SDK on the Responses
API, LangGraph's ReAct agent on chat completions), trained unmodified: pointed at the episode's
base URL only (examples/agents/frameworks.py). Their tool-using episodes are recorded as the
engine's exact tokens across the calls, and ``postrl train`` takes a step on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from postrl.rollout.agentic.agent_function import RecordedAgents
from postrl.serve.recording_server import RecordingServer
from postrl.types import Prompt, SamplingParams
from tests.chat_templates import family_tokenizer
from tests.conftest import make_tiny_model
from tests.scripted_engine import ScriptedEngine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
sys.path.insert(0, str(EXAMPLES))
import frameworks  # noqa: E402

FRAMEWORKS = ["agents_sdk", "langgraph_react"]
# what the model writes: a call as it likes to write it (compact), one as the template would, the answer
TURNS = [
    '<tool_call>\n{"name":"multiply","arguments":{"a":52,"b":30}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1560, "b": 504}}\n</tool_call>',
    "The answer is 2064.",
]


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_framework_agent_is_recorded_token_exactly_across_its_tool_calls(name):
    tokenizer = family_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine.script = list(TURNS)
    agents = RecordedAgents(RecordingServer.of_engine(engine, tokenizer), getattr(frameworks, name), workers=1)
    try:
        (rollout,) = agents.run(
            [Prompt("What is 52*30+504?", [], columns={"answer": "2064"})], SamplingParams(n=1, max_tokens=96)
        )
    finally:
        agents.close()
    episode = rollout.episode
    assert (episode.reward, episode.prefix_breaks, len(episode.turns), rollout.finish_reason) == (1.0, 0, 3, "stop")
    turn_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [engine.end_id] for t in TURNS]
    trained = [t for t, m in zip(rollout.response_ids, rollout.loss_mask) if m]
    assert trained == [t for ids in turn_ids for t in ids]  # the engine's tokens, none re-tokenized
    context = rollout.prompt_ids + rollout.response_ids
    for k, prompt in enumerate(engine.prompts):  # each call's prompt is the episode's exact context so far
        assert context[: len(prompt)] == prompt
        if k:
            assert (
                prompt[: len(engine.prompts[k - 1]) + len(turn_ids[k - 1])] == engine.prompts[k - 1] + turn_ids[k - 1]
            )


@pytest.fixture(scope="module")
def qwen_style_model(tmp_path_factory) -> Path:
    """A tiny random Llama with the Qwen2.5-style chat template (it renders tools=), long enough
    for the tools' schemas in characters."""
    out = tmp_path_factory.mktemp("qwen_style")
    tokenizer = family_tokenizer("qwen2.5")
    model = make_tiny_model("llama", tokenizer)
    model.config.max_position_embeddings = 4096
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_postrl_train_takes_a_step_on_a_framework_agent(tmp_path, qwen_style_model, name):
    """The example config, on a tiny model: the framework's calls reach the run's engine through
    the recording server and the step trains on the recorded episodes."""
    from postrl.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {a}*3+1?", "answer": str(3 * a + 1)}) + "\n" for a in range(4))
    )
    config = EXAMPLES / ("agents_sdk.yaml" if name == "agents_sdk" else "langgraph.yaml")
    args = [
        "train", str(config), f"output_dir={tmp_path}/runs", "name=fw", f"model.path={qwen_style_model}", "steps=1",
        f"data.train_files=[{data}]", "prompts_per_step=2", "rollout.n=2", "agent.max_context=4096",
        "agent.tools_in_prompt=template", "checkpoint.every_steps=0", "logging.trackers=[jsonl]",
        "train.mini_batch_size=4", "train.micro_batch_size=4",
    ]  # fmt: skip
    assert main(args) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "runs" / "fw" / "metrics.jsonl").read_text().splitlines()]
    assert row["agent/turns_mean"] >= 1 and row["perf/train_tokens_per_s"] > 0 and "agent/finish_env_error" not in row
