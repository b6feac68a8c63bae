"""An agent written against the OpenAI API, trained from its recorded calls: the recording server
builds each call's prompt from the episode's exact tokens, so the trajectory is the one the
in-process episode runner makes for the same episodes (greedy, the same engine)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.rollout.agentic.agent_function import RecordedAgents
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
from postrl.rollout.native import NativeRolloutWorker
from postrl.serve.recording_server import MODEL_NAME, RecordingServer
from postrl.types import Prompt, SamplingParams
from tests.test_agentic import ScriptedEnv

LIMITS = EpisodeLimits(max_turns=3, max_tokens_per_turn=12, max_context=128)
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=12)


def agent(client: openai.OpenAI, row: dict) -> float:
    """The same episode as ScriptedEnv(["go on", "once more"]) under the runner, through the API."""
    env = ScriptedEnv(["go on", "once more"], reward=0.5)
    messages = env.reset(row)
    for _ in range(LIMITS.max_turns):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0.0, max_tokens=12)
        choice = reply.choices[0]
        if choice.finish_reason == "length":
            return 0.0
        result = env.step(choice.message.content)
        if result.done:
            return result.reward
        messages += [{"role": "assistant", "content": choice.message.content}, *result.messages]
    return 0.0


@pytest.fixture
def demo():
    """The shipped demo model: its turns end (with </s>), so episodes have several."""
    tokenizer = load_tokenizer("demo")
    return NativeRolloutWorker.from_hf(load_causal_lm("demo"), tokenizer, torch.float32), tokenizer


def test_recorded_calls_are_the_in_process_trajectory(demo):
    engine, char_tokenizer = demo
    prompts = [Prompt(t, [], messages=None) for t in ("123+456=", "700+99=")]
    runner = EpisodeRunner(
        lambda ps, sp: engine.generate(ps, sp, None),
        lambda: ScriptedEnv(["go on", "once more"], 0.5),
        char_tokenizer,
        LIMITS,
    )
    local = runner.run(prompts, GREEDY)
    runner.close()
    agents = RecordedAgents(RecordingServer.of_engine(engine, char_tokenizer), agent, workers=4)
    try:
        served = agents.run(prompts, GREEDY)
        assert len(served) == len(local) == 4
        for a, b in zip(served, local):
            assert (a.prompt_index, a.prompt_ids, a.response_ids, a.loss_mask) == (
                b.prompt_index,
                b.prompt_ids,
                b.response_ids,
                b.loss_mask,
            )
            # batched differently (and from kept K/V): the same tokens, logprobs within fp32 noise
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
            assert a.episode.reward == (b.episode.reward if b.episode.finish_reason == "stop" else 0.0)
            assert len(a.episode.turns) == len(b.episode.turns)
        assert max(len(r.episode.turns) for r in served) == 3 and all(r.episode.prefix_breaks == 0 for r in served)
        assert not agents.recorders["policy"].episodes  # every recording was taken
        assert engine.kept.hits > 0  # the server's calls continued each episode from its kept K/V
        two = httpx.post(
            agents.episode_url("e") + "/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "n": 2, "max_tokens": 4},
        )
        assert two.status_code == 200 and len(two.json()["choices"]) == 2
        view = httpx.get(agents.endpoint.root + "/v1/episodes/e").json()  # each choice a sample, the second forked
        assert (len(view["samples"]), view["forks"]) == (2, 1)
    finally:
        agents.close()


def test_an_agent_that_raises_ends_its_episode_not_the_batch(demo):
    engine, char_tokenizer = demo

    def flaky(client, row):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
        )
        if row["prompt"] == "boom":
            raise RuntimeError("the agent broke")
        return 1.0

    agents = RecordedAgents(RecordingServer.of_engine(engine, char_tokenizer), flaky)
    try:
        out = agents.run([Prompt("fine", [], messages=None), Prompt("boom", [], messages=None)], SamplingParams(n=1))
    finally:
        agents.close()
    by_prompt = {r.prompt_index: r for r in out}
    lines = Path(__file__).read_text().splitlines()
    raise_line = next(i for i, line in enumerate(lines, 1) if line.strip() == 'raise RuntimeError("the agent broke")')
    assert by_prompt[0].episode.reward == 1.0 and by_prompt[0].finish_reason != "env_error"
    assert (
        by_prompt[1].finish_reason == "env_error"
        and by_prompt[1].episode.info["env_error"] == f"RuntimeError: the agent broke ({__file__}:{raise_line})"
        and 'raise RuntimeError("the agent broke")' in by_prompt[1].episode.info["env_traceback"]
    )


def test_postrl_train_runs_an_openai_api_agent_from_its_recordings(tmp_path, arithmetic_jsonl):
    """``agent.function``: whole steps on recorded episodes, with the agent's rewards."""
    from postrl.cli import main

    config = tmp_path / "agent.yaml"
    config.write_text("agent: {function: tests.test_recorded_agents:agent, max_context: 128}\n")
    args = [
        "train", str(config), f"output_dir={tmp_path}/runs", "name=agent", "model.path=demo", "steps=2",
        f"data.train_files=[{arithmetic_jsonl}]", "data.task=null", "prompts_per_step=2", "rollout.n=2",
        "checkpoint.every_steps=0", "logging.trackers=[jsonl]", "train.mini_batch_size=4",
        "train.micro_batch_size=4",
    ]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "agent" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["agent/turns_mean"] >= 1 for r in rows)
    assert {r["reward/environment/mean"] for r in rows} <= {0.0, 0.25, 0.5}  # the agent's rewards, 0.5 or 0
