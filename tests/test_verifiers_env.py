"""verifiers environments, unmodified (``agent.verifiers``): environments written as users write
them, from local rows (tests/verifiers_envs.py), played through verifiers' own OpenAI client on the
run's recording server over a real engine."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

vf = pytest.importorskip("verifiers", reason="verifiers is in the test extras (pip install -e '.[test]')")

from postrl.config.agent import VerifiersAgent  # noqa: E402
from postrl.config.loading import build_config  # noqa: E402
from postrl.controller.episode_scoring import EpisodeScoring  # noqa: E402
from postrl.data.dataset import build_prompts  # noqa: E402
from postrl.data.prompt_source import prompt_source  # noqa: E402
from postrl.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from postrl.rollout.agentic.verifiers_env import (  # noqa: E402
    VerifiersGroups,
    VerifiersLoadError,
    environment_rows,
    load_environment,
)
from postrl.rollout.native import NativeRolloutWorker  # noqa: E402
from postrl.serve.recording_server import RecordingServer  # noqa: E402
from postrl.types import SamplingParams  # noqa: E402
from tests.chat_templates import family_tokenizer  # noqa: E402
from tests.scripted_engine import ScriptedEngine  # noqa: E402
from tests.verifiers_envs import scoring_rubric  # noqa: E402

GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=12)


def environment(name: str, **args) -> object:
    return load_environment(VerifiersAgent(verifiers=f"tests.verifiers_envs:{name}", verifiers_args=args))


@pytest.fixture(scope="module")
def demo():
    tokenizer = load_tokenizer("demo")
    return NativeRolloutWorker.from_hf(load_causal_lm("demo"), tokenizer, torch.float32), tokenizer


def play(engine, tokenizer, env, sampling=GREEDY, rows=2, tools_in_prompt="template", workers=4):
    prompts = build_prompts(iter(list(environment_rows(env, "train"))[:rows]), tokenizer).prompts
    groups = VerifiersGroups(RecordingServer.of_engine(engine, tokenizer, tools_in_prompt), env, workers, 60)
    try:
        return prompts, groups.run(prompts, sampling)
    finally:
        groups.close()


def verifiers_rewards(row: dict, completions: list[list[dict]]) -> list[float]:
    """verifiers' own scoring of ``completions`` of ``row``: a fresh rubric's score_group over states
    made by verifiers from the row, each holding one completion."""
    from datasets import Dataset
    from verifiers.utils.message_utils import normalize_messages

    env = vf.SingleTurnEnv(dataset=Dataset.from_list([row]), rubric=scoring_rubric())
    client = vf.OpenAIChatCompletionsClient(vf.ClientConfig(api_base_url="http://127.0.0.1:9/v1"))

    async def score() -> list[float]:
        states = [await env.init_state(row, client, "m") for _ in completions]
        for state, completion in zip(states, completions, strict=True):
            state["completion"] = normalize_messages(completion, field_name="completion")
        await env.rubric.score_group(states)
        return [state["reward"] for state in states]

    return asyncio.run(score())


def test_a_group_is_token_exact_and_its_reward_is_verifiers_own_scoring(demo):
    engine, tokenizer = demo
    env = environment("load_single_turn")
    prompts, out = play(engine, tokenizer, env)
    assert [r.prompt_index for r in out] == [0, 0, 1, 1]
    for prompt in prompts:
        chat = prompt.columns["verifiers_row"]["prompt"]
        assert chat[0] == {"role": "system", "content": "Answer with the sum."}  # the environment's own formatting
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        alone = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_tokens=12), None)[0]
        group = [r for r in out if r.prompt_index == prompts.index(prompt)]
        for r in group:  # the engine's own tokens: the template's prompt, the greedy answer
            assert (r.prompt_ids, r.response_ids, r.loss_mask) == (
                ids,
                alone.response_ids,
                [1] * len(ids and r.response_ids),
            )
            assert r.episode.prefix_breaks == 0 and r.episode.info["stop_condition"] == "max_turns_reached"
        completions = [r.episode.messages[len(chat) :] for r in group]
        assert completions[0] == [
            {"role": "assistant", "content": tokenizer.decode(alone.response_ids, skip_special_tokens=True)}
        ]
        row = prompt.columns["verifiers_row"]
        assert [r.episode.reward for r in group] == pytest.approx(verifiers_rewards(row, completions), abs=1e-12)
        # every function's value is a metric; rank_in_group is a group function (ties ranked by position)
        assert [r.episode.metrics["rank_in_group"] for r in group] == [0.0, 0.5]
        assert {"reply_length", "has_digit", "num_turns"} <= set(group[0].episode.metrics)
    results = EpisodeScoring("environment", None).score(prompts, out)
    assert [res.reward for res in results] == [r.episode.reward for r in out]
    assert (
        results[1].components["rank_in_group"] == 0.5 and results[1].components["environment"] == out[1].episode.reward
    )


def test_a_multi_turn_game_trains_each_model_turn_once_between_the_environment_s_messages(demo):
    engine, tokenizer = demo
    _, out = play(engine, tokenizer, environment("load_game"), SamplingParams(n=2, temperature=1.0, max_tokens=8))
    assert len(out) == 4
    for r in out:
        assert len(r.episode.turns) == 3 and r.episode.metrics["num_turns"] == 3.0
        spans = [m for i, m in enumerate(r.loss_mask) if i == 0 or r.loss_mask[i - 1] != m]
        assert spans == [1, 0, 1, 0, 1]  # model, "2 left", model, "1 left", model
        inserted = tokenizer.decode([t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if not m])
        assert "2 left" in inserted and "1 left" in inserted
        assert r.episode.prefix_breaks == 0


def test_a_tool_environment_calls_its_python_tool_and_the_result_is_in_context():
    tokenizer = family_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine.script = ['<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 3}}\n</tool_call>', "It is 15."]
    _, (r,) = play(engine, tokenizer, environment("load_tool_env"), SamplingParams(n=1, max_tokens=400), rows=1)
    assert r.finish_reason == "stop" and "env_error" not in r.episode.info
    assert r.episode.metrics["add_calls"] == 1.0 and r.episode.metrics["total_tool_calls"] == 1.0
    assert r.episode.metrics["reply_length"] == pytest.approx(len("It is 15.") / 100)
    inserted = tokenizer.decode([t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if not m])
    assert "<tool_response>\n15\n</tool_response>" in inserted  # the tool's result, as the template renders it
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]  # the second call extends the first


def scripted(*texts: str) -> tuple:
    tokenizer = family_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine.script = list(texts)
    return engine, tokenizer


def test_a_stateful_tool_environment_fills_the_hidden_argument_from_the_episode():
    engine, tokenizer = scripted('<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>', "x is 42")
    _, (r,) = play(engine, tokenizer, environment("load_stateful"), SamplingParams(n=1, max_tokens=400), rows=1)
    assert "env_error" not in r.episode.info and r.episode.metrics["lookup_calls"] == 1.0
    inserted = tokenizer.decode([t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if not m])
    assert "<tool_response>\n42\n</tool_response>" in inserted  # the table came from the row, not the model
    assert '"table"' not in tokenizer.decode(engine.prompts[0])  # the hidden argument is not in the tool's schema


def test_verifiers_own_mcp_environment_calls_its_mcp_server(tmp_path):
    pytest.importorskip("mcp")
    server = str(Path(__file__).with_name("mcp_servers.py"))
    token = f"vf-mcp-{tmp_path.name}"
    engine, tokenizer = scripted('<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 3}}\n</tool_call>', "15")
    env = environment("load_mcp_env", server=server, token=token)
    _, (r,) = play(engine, tokenizer, env, SamplingParams(n=1, max_tokens=400), rows=1)
    assert "env_error" not in r.episode.info and r.episode.metrics["total_tool_calls"] == 1.0
    inserted = tokenizer.decode([t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if not m])
    assert "<tool_response>\n15\n</tool_response>" in inserted  # the MCP server's answer


def test_loading_an_environment_leaves_the_process_s_signal_handlers():
    """A verifiers Environment installs SIGINT/SIGTERM handlers when it is made; the run's stay."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    environment("load_single_turn", size=3)
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("load_raising_rubric", "reward function raising raised KeyError: 'no such field'"),
        ("load_wordy_rubric", "reward function wordy returned str 'yes', not a number"),
    ],
)
def test_a_rubric_function_that_fails_makes_its_group_unscorable_naming_it(name, reason):
    tokenizer = family_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine.script = ["15", "15"]
    prompts, out = play(engine, tokenizer, environment(name), SamplingParams(n=2, max_tokens=8), rows=1, workers=1)
    results = EpisodeScoring("environment", None).score(prompts, out)
    assert [res.error for res in results] == [f"environment rubric failed: RubricFunctionError: {reason}"] * 2
    assert all(r.finish_reason == "env_error" for r in out)


def test_the_eval_split_is_held_out_and_an_environment_without_one_holds_out_nothing(demo):
    _, tokenizer = demo
    config = build_config({"agent": {"verifiers": "tests.verifiers_envs:load_single_turn"}, "model": {"path": "demo"}})
    assert config.data.environment and config.data.task is None
    source = prompt_source(config.data, tokenizer, config.agent)
    train, held = source.train().prompts, source.held_out().prompts
    assert [p.columns["verifiers_row"]["info"]["q"] for p in held] == ["90+9=", "14+41="]
    assert len(train) == 8 and not {p.text for p in train} & {p.text for p in held}
    assert source.held_out_name == "tests.verifiers_envs:load_single_turn eval"
    alone = build_config({"agent": {"verifiers": "tests.verifiers_envs:load_train_only"}, "model": {"path": "demo"}})
    assert prompt_source(alone.data, tokenizer, alone.agent).held_out() is None


def test_bad_environments_are_refused_naming_them():
    with pytest.raises(
        ValueError, match="agent.verifiers='no-such-env': no environment package 'no_such_env' is installed"
    ):
        VerifiersAgent(verifiers="no-such-env")
    with pytest.raises(
        VerifiersLoadError,
        match=r"load_environment\(rows_file='x.jsonl'\) raised FileNotFoundError: no rows at x.jsonl",
    ):
        environment("load_broken", rows_file="x.jsonl")
    with pytest.raises(VerifiersLoadError, match="load_environment returned dict, not a verifiers Environment"):
        environment("load_not_an_env")
    with pytest.raises(ValueError, match="agent.max_turns is not read by an agent.verifiers run"):
        VerifiersAgent.model_validate({"verifiers": "tests.verifiers_envs:load_game", "max_turns": 3})
    with pytest.raises(
        ValueError, match="agent.verifiers: the prompts are the environment's own dataset .* remove data.task"
    ):
        build_config({"agent": {"verifiers": "tests.verifiers_envs:load_game"}, "data": {"task": "arithmetic"}})
    with pytest.raises(
        ValueError, match="data.environment: the prompts of an environment's own dataset need agent.verifiers"
    ):
        build_config({"data": {"environment": True}})


@pytest.mark.slow
def test_postrl_train_and_eval_run_a_verifiers_environment(tmp_path, capsys):
    from postrl.cli import main

    config = tmp_path / "vf.yaml"
    config.write_text("agent: {verifiers: tests.verifiers_envs:load_single_turn, max_context: 128}\n")
    args = [
        "train", str(config), f"output_dir={tmp_path}/runs", "name=vf", "model.path=demo", "steps=2",
        "prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=8", "checkpoint.every_steps=0",
        "logging.trackers=[jsonl]", "train.mini_batch_size=4", "train.micro_batch_size=4",
    ]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "vf" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["reward/num_turns/mean"] == 1.0 for r in rows)  # the rubric's metrics
    assert all(0 < r["reward/reply_length/mean"] and 0 <= r["reward/rank_in_group/mean"] <= 0.5 for r in rows)
    assert all(r["reward/environment/mean"] == r["reward/mean"] for r in rows)
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "runs" / "vf"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sets"]["tests.verifiers_envs:load_single_turn eval"]["prompts"] == 2


def test_postrl_train_with_a_loader_that_raises_stops_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from postrl.cli import main
    from postrl.run import train_runner

    def no_model(*args, **kwargs):
        raise AssertionError("the model was placed before the environment loaded")

    monkeypatch.setattr(train_runner, "place_policy", no_model)
    config = tmp_path / "broken.yaml"
    config.write_text(
        "agent: {verifiers: tests.verifiers_envs:load_broken, verifiers_args: {rows_file: r.jsonl}, max_context: 128}\n"
    )
    assert main(["train", str(config), f"output_dir={tmp_path}", "model.path=demo"]) == 2
    assert (
        "postrl train: error: agent.verifiers='tests.verifiers_envs:load_broken': "
        "load_environment(rows_file='r.jsonl') raised FileNotFoundError: no rows at r.jsonl"
    ) in capsys.readouterr().err


def test_a_tool_environment_shown_through_a_template_that_drops_tools_is_refused_at_start(tmp_path, capsys):
    """The demo model's template ignores tools=: with agent.tools_in_prompt: template the model
    would never see the environment's tools, so the run stops before its first step, naming the
    tools and the field to change (every episode failed at its first call before)."""
    from postrl.cli import main

    config = tmp_path / "tools.yaml"
    config.write_text("agent: {verifiers: tests.verifiers_envs:load_tool_env, max_context: 128}\n")
    assert main(["train", str(config), f"output_dir={tmp_path}", "model.path=demo", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert (
        "postrl train: error: agent.tools_in_prompt=template: the chat template of demo ignores tools=, so the model "
        "would never see the tools of agent.verifiers=tests.verifiers_envs:load_tool_env (add); set "
        "agent.tools_in_prompt: system"
    ) in err, err
    assert not any(p.read_text() for p in tmp_path.rglob("metrics.jsonl"))  # no step ran
