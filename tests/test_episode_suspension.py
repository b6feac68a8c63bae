"""A checkpoint suspends episodes between turns and a restart continues them: the saved batch goes
through the checkpoint's own format, every episode ends once with all its turns and rewards (none
lost, none doubled), an environment that cannot save its state runs to its end instead, and the
python tool's interpreter state comes back in a new interpreter."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from postrl.controller.generated import Generated
from postrl.rollout.agentic.env import StepResult, ToolEnvironment
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
from postrl.rollout.agentic.individual import Individual
from postrl.rollout.native import NativeRolloutWorker
from postrl.types import Prompt, SamplingParams
from tests.chat_templates import family_tokenizer
from tests.conftest import make_tiny_model

LIMITS = EpisodeLimits(max_turns=3, max_tokens_per_turn=6, max_context=1024, end_on_turn_length=False)
SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=6)
STEPS: list[str] = []  # every environment step taken, by episode name, in all runs of a test


class SavableSlowEnv:
    """Rewards each step 1 after ``row['delay']`` s; saves which episode it is and its steps."""

    tools: list = []

    def __init__(self) -> None:
        self.name, self.delay, self.steps = "", 0.0, 0

    def reset(self, row: dict) -> list[dict]:
        self.name, self.delay = row["name"], float(row["delay"])
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> StepResult:
        time.sleep(self.delay)
        self.steps += 1
        STEPS.append(self.name)
        return StepResult([{"role": "user", "content": f"step {self.steps}"}], reward=1.0)

    def state_dict(self) -> dict:
        return {"name": self.name, "delay": self.delay, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.name, self.delay, self.steps = state["name"], state["delay"], state["steps"]

    def close(self) -> None:
        pass


class UnsavableSlowEnv(SavableSlowEnv):
    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


def runner_for(model_and_tokenizer, env=SavableSlowEnv) -> EpisodeRunner:
    model, tokenizer = model_and_tokenizer
    engine = NativeRolloutWorker.from_hf(model, tokenizer)
    runner = EpisodeRunner(
        lambda ps, sp: engine.generate(ps, sp, None), env, tokenizer, LIMITS, schedule=Individual(joins_calls=True)
    )
    runner.engine = engine  # type: ignore[attr-defined]
    return runner


PROMPTS = [
    Prompt(f"q{i}", [], columns={"name": f"e{i}", "prompt": f"question {i}", "delay": d})
    for i, d in enumerate([0.0, 0.15, 0.3])
]


def suspended_run(model_and_tokenizer, env=SavableSlowEnv):
    """Run the batch and suspend it as a checkpoint does once 2 environment steps were taken."""
    STEPS.clear()
    runner = runner_for(model_and_tokenizer, env)
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(runner.run(PROMPTS, SAMPLING)))
    thread.start()
    deadline = time.monotonic() + 30
    while len(STEPS) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    runner.suspend()
    runner.engine.suspend()
    thread.join(60)
    return out


def test_a_suspended_batch_is_saved_restored_and_every_episode_ends_once(model_and_tokenizer, tmp_path):
    rollouts = suspended_run(model_and_tokenizer)
    suspended = [r for r in rollouts if r.finish_reason == "suspended"]
    assert suspended and len(rollouts) == len(PROMPTS) * SAMPLING.n  # one row per episode, done or not
    assert all(r.episode.saved is not None and not r.response_ids for r in suspended)
    steps_before = len(STEPS)

    path = tmp_path / "in_flight.pt"
    torch.save(Generated(7, PROMPTS, rollouts, 0.0).state_dict(), path)  # as a checkpoint saves it
    restored = Generated.of_state(torch.load(path, weights_only=True))
    assert restored.suspended and restored.rollouts[0].episode is not None
    assert [r.episode.saved.sample.prompt_ids for r in restored.rollouts if r.episode.saved] == [
        r.episode.saved.sample.prompt_ids for r in suspended
    ]

    finished = runner_for(model_and_tokenizer).resume(restored.prompts, restored.rollouts, SAMPLING)
    assert [r.prompt_index for r in finished] == [0, 0, 1, 1, 2, 2]
    for r in finished:
        assert r.finish_reason == "max_turns" and r.episode.finish_reason == "max_turns"
        assert len(r.episode.turns) == 3 and r.episode.reward == 3.0  # every step rewarded once
        assert sum(r.loss_mask) == sum(t.generated_tokens for t in r.episode.turns)
    assert len(STEPS) == 3 * len(finished) and len(STEPS) > steps_before  # no step lost or taken twice
    assert sorted(STEPS) == sorted([f"e{i}" for i in range(3) for _ in range(2 * 3)])


def test_an_episode_whose_environment_cannot_save_runs_to_its_end(model_and_tokenizer):
    rollouts = suspended_run(model_and_tokenizer, UnsavableSlowEnv)
    assert [r.finish_reason for r in rollouts] == ["max_turns"] * 6
    assert all(r.episode.reward == 3.0 for r in rollouts)


@pytest.mark.slow
def test_the_python_tools_variables_come_back_in_a_new_interpreter():
    env = ToolEnvironment(["python"])
    env.reset({"prompt": "compute", "answer": "42"})
    first = env.step(
        '<tool_call>{"name": "python", "arguments": {"code": "x = 40\\nopen(\'f.txt\', \'w\').write(\'2\')"}}</tool_call>'
    )
    assert first.tool_calls[0].error is None
    saved = env.state_dict()
    env.close()  # the interpreter and its working directory are gone
    again = ToolEnvironment(["python"])
    again.load_state_dict(saved)
    try:
        reply = again.step(
            '<tool_call>{"name": "python", "arguments": {"code": "print(x + int(open(\'f.txt\').read()))"}}</tool_call>'
        )
        assert reply.messages[0]["content"].strip() == "42"
        fresh = ToolEnvironment(["python"])
        fresh.reset({"prompt": "compute", "answer": "42"})
        lost = fresh.step('<tool_call>{"name": "python", "arguments": {"code": "print(x)"}}</tool_call>')
        assert "NameError" in lost.messages[0]["content"]  # what the replay restored is not there otherwise
        fresh.close()
    finally:
        again.close()


AGENT_STEPS = 8


def kill_at_a_suspending_checkpoint(tmp_path, rows: list[dict], agent: dict, steps: int = AGENT_STEPS):
    """An async run (overlap=generation, a checkpoint every step) of ``agent`` episodes on a tiny
    Qwen-style model, through the trained-samples recorder of test_async: SIGKILLed as soon as a
    checkpoint holds a suspended batch, then resumed to its end. Returns (the step it was killed
    after, that checkpoint's in-flight batch, the (batch, row) ids trained before and after the kill,
    the run's metrics)."""
    import json
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
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = write_config(
        tmp_path, model_dir, data, steps=steps, prompts_per_step=2,
        controller={"mode": "async", "overlap": "generation", "serial_compute": False}, buffer={"max_staleness": 1},
        rollout={"n": 2, "max_tokens": 6}, reward={"num_workers": 1}, agent=agent,
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
    assert step < steps - 1, "no checkpoint met episodes in progress"
    _resume_recorded(script, run_dir, dict(env, TRAINED_LOG=str(tmp_path / "second.log")))
    before, after = _trained(tmp_path / "first.log", upto=step), _trained(tmp_path / "second.log")
    ids = [(b, r) for samples in (*before.values(), *after.values()) for b, r, _ in samples]
    return step, in_flight, ids, read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_an_async_agent_run_killed_after_a_checkpoint_trains_every_episode_once(tmp_path):
    """overlap=generation with episodes: a checkpoint suspends the batch being generated between
    turns and saves it; killed there (SIGKILL) and resumed, the run continues those episodes from
    their saved state and trains every episode once, each with all 3 of its rewarded steps."""
    rows = [{"prompt": f"q {i}", "name": f"r{i}", "delay": 0.05 + 0.05 * (i % 4)} for i in range(8)]
    agent = {"env": "tests.test_episode_suspension:SavableSlowEnv", "max_turns": 3, "max_tokens_per_turn": 6,
             "max_context": 1024, "on_turn_length": "continue"}  # fmt: skip
    _, in_flight, ids, rows_out = kill_at_a_suspending_checkpoint(tmp_path, rows, agent)
    saved = [r for r in in_flight["rollouts"] if r["finish_reason"] == "suspended"]
    assert all(r["episode"]["saved"]["env_state"]["name"].startswith("r") for r in saved)
    assert len(ids) == len(set(ids)) == AGENT_STEPS * 4 and {b for b, _ in ids} == set(range(1, AGENT_STEPS + 1))
    assert [r["step"] for r in rows_out] == list(range(1, AGENT_STEPS + 1))
    assert all(r["reward/mean"] == 3.0 and r["agent/turns_mean"] == 3.0 for r in rows_out)  # no step lost or doubled
