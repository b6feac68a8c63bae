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
    agents = RecordedAgents(RecordingServer(engine, tokenizer), tokenizer, slow_agent, workers=4)
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


AGENT_STEPS = 8


@pytest.mark.slow
def test_an_async_function_run_killed_mid_episode_trains_every_episode_once(tmp_path):
    """overlap=generation with agent.function: a checkpoint suspends the batch being generated; killed
    there (SIGKILL) and resumed, the run re-runs those episodes (their recorded calls replayed) and
    trains every episode once, each rewarded for all three of its calls."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from postrl.run.metrics import read_metrics
    from tests.test_async import RECORDER, _resume_recorded, _trained
    from tests.test_train_e2e import write_config

    model_dir = tmp_path / "model"
    tokenizer = family_tokenizer("qwen2.5")
    model = make_tiny_model("llama", tokenizer)
    model.config.max_position_embeddings = 1024
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q {i}", "delay": 0.05 + 0.05 * (i % 4)}) + "\n" for i in range(8)))
    config = write_config(
        tmp_path, model_dir, data, steps=AGENT_STEPS, prompts_per_step=2,
        controller={"mode": "async", "overlap": "generation", "serial_compute": False}, buffer={"max_staleness": 1},
        rollout={"n": 2, "max_tokens": 6}, reward={"num_workers": 1},
        agent={"function": "tests.test_function_suspension:slow_agent", "max_context": 1024},
        train={"lr": 1e-3, "mini_batch_size": 4, "micro_batch_size": 4},
        checkpoint={"every_steps": 1, "keep_last": 40},
    )  # fmt: skip
    run_dir = tmp_path / "runs" / "tiny"
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, TRAINED_LOG=str(tmp_path / "first.log"), RAY_AUTH_MODE="disabled", PYTHONPATH=root)
    first = subprocess.Popen(
        [sys.executable, str(script), "train", config], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline, step, in_flight = time.time() + 240, 0, None
    while in_flight is None or not any(r["finish_reason"] == "suspended" for r in in_flight["rollouts"]):
        assert first.poll() is None and time.time() < deadline, (
            first.stderr.read().decode()[-3000:] if first.poll() is not None else "timeout"
        )
        nxt = run_dir / "checkpoints" / f"step_{step + 1:08d}"
        if (nxt / "COMPLETE").exists():
            step += 1
            in_flight = torch.load(nxt / "run_state.pt", weights_only=True)["pipeline"]["in_flight"]
        else:
            time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert step < AGENT_STEPS - 1, "no checkpoint met episodes in progress"
    saved = [r for r in in_flight["rollouts"] if r["finish_reason"] == "suspended"]
    assert all(r["episode"]["calls"]["episode_id"] for r in saved)
    _resume_recorded(script, run_dir, dict(env, TRAINED_LOG=str(tmp_path / "second.log")))
    before, after = _trained(tmp_path / "first.log", upto=step), _trained(tmp_path / "second.log")
    ids = [(b, r) for samples in (*before.values(), *after.values()) for b, r, _ in samples]
    assert len(ids) == len(set(ids)) == AGENT_STEPS * 4 and {b for b, _ in ids} == set(range(1, AGENT_STEPS + 1))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, AGENT_STEPS + 1))
    assert all(r["reward/mean"] == 3.0 for r in rows)  # every episode answered all three calls, once
    assert sum(r["agent/reruns"] for r in rows) >= len(saved) > 0
    # the resumed run answered the saved episodes' calls from the checkpoint (and later suspensions' too)
    assert sum(r["agent/replayed_calls"] for r in rows) >= sum(len(r["episode"]["calls"]["calls"]) for r in saved) > 0
