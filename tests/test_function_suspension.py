"""agent.function episodes under overlap=generation: a checkpoint suspends them between model calls;
each runs again from its start, its recorded calls replayed, so no episode is lost or trained twice."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from postrl.rollout.agentic.agent_function import RecordedAgents
from postrl.serve.recording_server import MODEL_NAME, RecordingServer
from postrl.types import Prompt, SamplingParams
from tests.chat_templates import family_tokenizer
from tests.conftest import make_tiny_model
from tests.test_episode_suspension import AGENT_STEPS, kill_at_a_suspending_checkpoint

TURNS = 3


def slow_agent(client, row: dict) -> float:
    """Three model calls with a tool's delay after each; rewarded 3 when all three were answered."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(TURNS):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        time.sleep(row["delay"])
        messages += [{"role": "user", "content": "go on"}]
    return float(TURNS)


@pytest.fixture
def agents():
    from postrl.rollout.native import NativeRolloutWorker

    tokenizer = family_tokenizer("qwen2.5")
    model = make_tiny_model("llama", tokenizer)
    engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=0)
    agents = RecordedAgents(RecordingServer.of_engine(engine, tokenizer), slow_agent, workers=4)
    yield agents, engine
    agents.close()


PROMPTS = [Prompt(f"q {i}", [], columns={"delay": 0.1 + 0.05 * i}) for i in range(3)]
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=6)


def test_a_suspended_function_episode_reruns_from_its_recorded_calls(agents):
    """Suspended mid-way, each unfinished episode comes back with its completed calls; its re-run is
    answered from them (no engine work) and then goes on: the trajectories equal an uninterrupted
    run's (greedy), every call once."""
    agents, engine = agents
    whole = agents.run(PROMPTS, GREEDY)
    timer = threading.Timer(0.35, agents.suspend)
    timer.start()
    cut = agents.run(PROMPTS, GREEDY)
    timer.join()
    suspended = [r for r in cut if r.finish_reason == "suspended"]
    assert suspended and all(r.episode.calls is not None for r in suspended)
    assert any(r.episode.calls.calls for r in suspended)  # some had completed calls to replay
    from dataclasses import asdict

    from postrl.controller.generated import rollout_of_state

    restored = [rollout_of_state(json.loads(json.dumps(asdict(r)))) for r in cut]  # as a checkpoint holds it
    finished = agents.rerun(PROMPTS, restored)
    assert [r.prompt_index for r in finished] == [r.prompt_index for r in whole]
    for a, b in zip(finished, whole, strict=True):
        assert (a.prompt_ids, a.response_ids, a.loss_mask, a.episode.reward) == (
            b.prompt_ids,
            b.response_ids,
            b.loss_mask,
            b.episode.reward,
        )
    reruns = [r for r in finished if r.episode.info.get("rerun")]
    assert len(reruns) == len(suspended)
    replayed = sum(r.episode.info["replayed_calls"] for r in reruns)
    assert replayed == sum(len(r.episode.calls.calls) for r in suspended) > 0


@pytest.mark.slow
def test_an_async_function_run_killed_mid_episode_trains_every_episode_once(tmp_path):
    """overlap=generation with agent.function: a checkpoint suspends the batch being generated; killed
    there (SIGKILL) and resumed, the run re-runs those episodes (their recorded calls replayed) and
    trains every episode once, each rewarded for all three of its calls."""
    rows = [{"prompt": f"q {i}", "delay": 0.05 + 0.05 * (i % 4)} for i in range(8)]
    agent = {"function": "tests.test_function_suspension:slow_agent", "max_context": 1024}
    _, in_flight, ids, metrics = kill_at_a_suspending_checkpoint(tmp_path, rows, agent)
    saved = [r for r in in_flight["rollouts"] if r["finish_reason"] == "suspended"]
    assert all(r["episode"]["calls"]["episode_id"] for r in saved)
    assert len(ids) == len(set(ids)) == AGENT_STEPS * 4 and {b for b, _ in ids} == set(range(1, AGENT_STEPS + 1))
    assert [r["step"] for r in metrics] == list(range(1, AGENT_STEPS + 1))
    assert all(r["reward/mean"] == 3.0 for r in metrics)  # every episode answered all three calls, once
    assert sum(r["agent/reruns"] for r in metrics) >= len(saved) > 0
    # the resumed run answered the saved episodes' calls from the checkpoint (and later suspensions' too)
    replayed = sum(r["agent/replayed_calls"] for r in metrics)
    assert replayed >= sum(len(r["episode"]["calls"]["calls"]) for r in saved) > 0
