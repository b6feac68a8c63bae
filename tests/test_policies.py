"""Several trainable policies in one run (``policies:``): each call reaches the policy it names, each
policy's samples hold its own turns only, each policy trains, checkpoints and resumes as its own run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from postrl.config.run import RunConfig
from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.rollout.agentic.agent_function import RecordedAgents
from postrl.rollout.native import NativeRolloutWorker
from postrl.run.plots import policy_prefixes
from postrl.serve.recording_server import RecordingServer, ServedPolicy
from postrl.types import Prompt, SamplingParams
from tests import policy_agents

SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=6)


@pytest.fixture
def two_engines(tiny_model_dir):
    """Two different models with one tokenizer: the demo model and a tiny random one."""
    tokenizer = load_tokenizer("demo")
    engines = {
        "proposer": NativeRolloutWorker.from_hf(load_causal_lm("demo"), tokenizer, torch.float32),
        "solver": NativeRolloutWorker.from_hf(load_causal_lm(str(tiny_model_dir)), tokenizer, torch.float32),
    }
    return engines, tokenizer


def served(engines, tokenizer):
    return RecordingServer({name: ServedPolicy(e, tokenizer) for name, e in engines.items()})


@pytest.mark.parametrize("function", [policy_agents.propose_and_solve, policy_agents.by_base_url])
def test_each_policys_samples_are_its_own_calls(two_engines, function):
    """Every call reaches the policy it names (by model, or by base URL), and each policy's rollouts
    are exactly its own calls: prompt tokens, response tokens and logprobs from its own engine."""
    engines, tokenizer = two_engines
    policy_agents.CALLS.clear()
    agents = RecordedAgents(served(engines, tokenizer), function, workers=2)
    try:
        prompts = [Prompt(t, []) for t in ("12+34=", "5+6=", "70+8=")]
        out = agents.run_policies(prompts, SAMPLING)
    finally:
        agents.close()
    assert set(out) == {"proposer", "solver"}
    assert len(out["proposer"]) == len(out["solver"]) == 6  # one call each per episode: one sample each
    for name, rollouts in out.items():
        calls = sorted((prompt, text) for model, prompt, text in policy_agents.CALLS if model == name)
        assert len(calls) == 6
        own = sorted(
            (r.episode.messages[0]["content"], tokenizer.decode(r.response_ids, skip_special_tokens=True))
            for r in rollouts
        )
        assert own == calls  # this policy's calls, and no other policy's
        for r in rollouts:  # the tokens are its own engine's: rescored there they give its logprobs
            rescored = engines[name].prompt_logprobs([r.prompt_ids + r.response_ids])[0][len(r.prompt_ids) - 1 :]
            assert torch.allclose(torch.tensor(rescored), torch.tensor(r.logprobs), atol=1e-4)
            other = engines["solver" if name == "proposer" else "proposer"]
            theirs = other.prompt_logprobs([r.prompt_ids + r.response_ids])[0][len(r.prompt_ids) - 1 :]
            assert not torch.allclose(torch.tensor(theirs), torch.tensor(r.logprobs), atol=1e-2)


def test_rewards_by_policy_and_their_mistakes(two_engines):
    engines, tokenizer = two_engines
    prompts = [Prompt("12+34=", [])]
    agents = RecordedAgents(served(engines, tokenizer), policy_agents.propose_and_solve, workers=1)
    try:
        out = agents.run_policies(prompts, SAMPLING)
        for name in ("proposer", "solver"):
            calls = [text for model, _, text in policy_agents.CALLS[-2:] if model == name]
            assert out[name][-1].episode.reward == sum(c.isdigit() for c in calls[0]) / 6
        agents.function = policy_agents.solver_only  # a policy that did not act has no rollout
        out = agents.run_policies(prompts, SAMPLING)
        assert out["proposer"] == [] and len(out["solver"]) == 2
        agents.function = policy_agents.leaves_out_the_solver  # a reward missing for a policy that acted
        out = agents.run_policies(prompts, SAMPLING)
        solver = out["solver"][0].episode
        assert "leave out ['solver']" in solver.info["env_error"] and out["solver"][0].finish_reason == "env_error"
    finally:
        agents.close()


def test_a_call_to_no_policy_is_refused_naming_them(two_engines):
    import openai

    engines, tokenizer = two_engines
    server = served(engines, tokenizer)
    try:
        client = openai.OpenAI(base_url=f"{server.root}/episodes/e1/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="this run's policies are proposer, solver"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1="}])
        assert [m.id for m in client.models.list().data] == ["proposer", "solver"]
        import httpx

        not_json = httpx.post(f"{server.root}/episodes/e1/v1/chat/completions", content=b"[1, 2]")
        assert not_json.status_code == 400 and "not a JSON object" in not_json.json()["error"]["message"]
        bad = openai.OpenAI(base_url=f"{server.root}/policies/critic/episodes/e1/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no policy 'critic'"):
            bad.chat.completions.create(model="critic", messages=[{"role": "user", "content": "1+1="}])
    finally:
        server.close()


def test_policy_sections_merge_over_the_run_and_bad_ones_are_named():
    base = {"model": {"path": "demo"}, "agent": {"function": "tests.policy_agents:propose_and_solve"}}
    config = RunConfig.model_validate(
        {**base, "train": {"lr": 1e-4}, "policies": {"proposer": {"train": {"lr": 1e-3}}, "solver": {}}}
    )
    runs = config.policy_runs()
    assert (runs["proposer"].train.lr, runs["solver"].train.lr) == (1e-3, 1e-4)
    assert runs["solver"].run_dir == config.run_dir / "policies" / "solver"
    bad = {
        "policies.proposer: unknown config field 'train.lrr'": {"proposer": {"train": {"lrr": 1}}, "solver": {}},
        "policies.proposer.rollout.n": {"proposer": {"rollout": {"n": 4}}, "solver": {}},
        "names one policy": {"solver": {}},
    }
    for message, policies in bad.items():
        with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("[", r"\[")):
            RunConfig.model_validate({**base, "policies": policies})
    with pytest.raises(ValueError, match="agent.function"):
        RunConfig.model_validate({"model": {"path": "demo"}, "policies": {"a": {}, "b": {}}})
    ray_async = {"controller": {"mode": "async"}, "scheduler": {"type": "ray"}, "buffer": {"max_staleness": 1}}
    with pytest.raises(ValueError, match=r"overlap=generation \(auto under Ray\) .* set controller.overlap=scoring"):
        RunConfig.model_validate({**base, **ray_async, "policies": {"proposer": {}, "solver": {}}})
    scoring = {**ray_async, "controller": {"mode": "async", "overlap": "scoring"}}
    RunConfig.model_validate({**base, **scoring, "policies": {"proposer": {}, "solver": {}}})
    overlap = {"controller": {"mode": "async", "overlap": "generation"}, "buffer": {"max_staleness": 1}}
    with pytest.raises(ValueError, match="overlap=generation .* not supported with several policies"):
        RunConfig.model_validate({**base, **overlap, "policies": {"proposer": {}, "solver": {}}})


def train_args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    config = tmp_path / "two.yaml"
    config.write_text(
        "agent: {function: tests.policy_agents:propose_and_solve, max_context: 128, env_workers: 1}\n"
        "policies:\n  proposer: {train: {lr: 0.001}}\n  solver: {}\n"
    )
    return [
        "train", str(config), f"output_dir={tmp_path}/runs", "name=two", "model.path=demo",
        f"data.train_files=[{data}]", "data.task=null", "prompts_per_step=2", "rollout.n=2",
        "logging.trackers=[jsonl]", "train.mini_batch_size=4", "train.micro_batch_size=4", *extra,
    ]  # fmt: skip


def test_postrl_train_steps_every_policy_on_its_own_samples(tmp_path, arithmetic_jsonl, capsys):
    from transformers import AutoModelForCausalLM

    from postrl.cli import main

    policy_agents.CALLS.clear()
    assert main(train_args(tmp_path, arithmetic_jsonl, "steps=2", "checkpoint.every_steps=1")) == 0
    said = capsys.readouterr()
    err = said.err  # one train() for any number of policies: every policy's start-up lines
    for name in ("proposer", "solver"):
        assert f"{name}: workers: train 1 rank in this process" in err
        assert f"{name}: numerics: engine " in err and f"{name}: accuracy: " in err
    run = tmp_path / "runs" / "two"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert f"plot: {run / 'reward_accuracy.png'}" in said.out + err  # a line per policy
    assert policy_prefixes(rows) == ["proposer/", "solver/"]
    for name in ("proposer", "solver"):
        assert all(r[f"{name}/reward/samples"] == 4 for r in rows)
        samples = [json.loads(line) for line in (run / "policies" / name / "samples" / "step_1.jsonl").open()]
        calls = [(prompt, text) for model, prompt, text in policy_agents.CALLS[:8] if model == name]
        assert sorted(s["response"].replace("</s>", "") for s in samples) == sorted(text for _, text in calls)
        checkpoint = run / "checkpoints" / "step_00000002" / "policies" / name
        assert (checkpoint / "model" / "config.json").is_file()
        AutoModelForCausalLM.from_pretrained(run / "final_model" / name)
    state = torch.load(run / "checkpoints" / "step_00000002" / "run_state.pt", weights_only=True)
    assert state["step"] == 2 and set(state["policies"]) == {"proposer", "solver"}
    # the proposer's lr is 100x the solver's: its weights moved further from the start
    start = load_causal_lm("demo").state_dict()
    moved = {
        name: sum(
            (p - start[k]).abs().sum().item()
            for k, p in AutoModelForCausalLM.from_pretrained(run / "final_model" / name).state_dict().items()
        )
        for name in ("proposer", "solver")
    }
    assert moved["proposer"] > 10 * moved["solver"] > 0


def test_replay_samples_each_policy_s_own_window(tmp_path, arithmetic_jsonl):
    """buffer.replay per policy: each policy's batch is sampled from its own last two steps' samples
    (at step 2 some are a version old), never from the other policy's."""
    from postrl.cli import main

    replay = ["steps=2", "buffer.max_staleness=1", "buffer.replay={capacity_steps: 2, reuse_limit: 2}", "seed=3"]
    assert main(train_args(tmp_path, arithmetic_jsonl, *replay)) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "two" / "metrics.jsonl").read_text().splitlines()]
    for name in ("proposer", "solver"):
        assert rows[0][f"{name}/buffer/lag_max"] == 0.0 and rows[1][f"{name}/buffer/lag_max"] == 1.0
        assert all(r[f"{name}/reward/samples"] == 4 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["controller.mode=async", "buffer.max_staleness=1"]], ids=["sync", "async"])
def test_a_run_killed_and_resumed_trains_every_policy_as_the_straight_run(tmp_path, arithmetic_jsonl, mode):
    """kill -9 in the middle of a step, then --resume: every policy restarts from the same checkpoint
    and the run ends as the uninterrupted one does, metric for metric and weight for weight (async:
    each policy's batch generated ahead is in the checkpoint, and trained once)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from postrl.cli import main
    from postrl.run.checkpoint import latest_checkpoint
    from postrl.run.metrics import read_metrics

    steps = ["steps=4", "checkpoint.every_steps=1", "rollout.temperature=1.0", *mode]
    (tmp_path / "a").mkdir()
    assert main(train_args(tmp_path / "a", arithmetic_jsonl, *steps)) == 0
    (tmp_path / "b").mkdir()
    env = {**os.environ, "POLICY_AGENT_DELAY_S": "0.3"}
    cmd = [sys.executable, "-m", "postrl", *train_args(tmp_path / "b", arithmetic_jsonl, *steps)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run_b = tmp_path / "b" / "runs" / "two"
    deadline = time.monotonic() + 120
    while latest_checkpoint(run_b) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = int(latest_checkpoint(run_b).name.split("_")[1])
    assert killed_at < 4, proc.stderr.read().decode()[-2000:]
    assert main(["train", "--resume", str(run_b), "steps=4"]) == 0

    run_a = tmp_path / "a" / "runs" / "two"
    rows_a, rows_b = read_metrics(run_a / "metrics.jsonl"), read_metrics(run_b / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        for name in ("proposer", "solver"):
            for key in ("reward/mean", "reward/samples", "actor/loss", "actor/grad_norm", "response/length_mean"):
                assert ra[f"{name}/{key}"] == rb[f"{name}/{key}"], (ra["step"], name, key)
    for name in ("proposer", "solver"):
        wa = load_file(str(run_a / "final_model" / name / "model.safetensors"))
        wb = load_file(str(run_b / "final_model" / name / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
    for name in ("proposer", "solver"):  # both learned: the comparison above compares updates
        assert any(r[f"{name}/actor/grad_norm"] > 0 for r in rows_a), name


def test_the_memory_plan_adds_up_the_policies_on_one_device():
    """Each policy fits the device alone, both do not: refused, naming each policy's share; one
    device that holds both passes."""
    from postrl.config.run import ConfigError
    from postrl.run.plan.check import check_policies_plan, shared_device_bytes
    from postrl.run.plan.gpus import GpuSpec
    from postrl.run.plan.inputs import Target

    config = RunConfig.model_validate(
        {
            "model": {"path": "demo"},
            "agent": {"function": "tests.policy_agents:propose_and_solve"},
            "policies": {"proposer": {}, "solver": {}},
        }
    )
    alone = check_policies_plan(config, print, Target(GpuSpec("big", 100.0, 1.0, 1.0), 1.0, False))
    need = {name: shared_device_bytes(run, alone[name]) for name, run in config.policy_runs().items()}
    between = Target(GpuSpec("small", 1.5 * need["proposer"] / 1e9, 1.0, 1.0), 1.0, False)
    with pytest.raises(ConfigError, match=r"the policies on cpu need .* \(proposer .* GB, solver .* GB\)"):
        check_policies_plan(config, print, between)
    warned: list[str] = []
    config.plan.check = "warn"
    check_policies_plan(config, warned.append, between)
    assert len(warned) == 1 and warned[0].startswith("warning: the run may not fit")


@pytest.mark.serial
@pytest.mark.slow
def test_two_policies_under_ray_each_on_its_own_placement(tmp_path, arithmetic_jsonl):
    """scheduler: ray: each policy's trainer and engine are actors in its own placement groups on a
    local Ray instance started for the run (holding the CPUs of both); both train; nothing is left."""
    pytest.importorskip("ray")
    from postrl.cli import main
    from tests.test_ray import ray_processes

    assert not ray_processes()
    ray = ["scheduler.type=ray", "scheduler.rollout.threads=1", "scheduler.train.threads=1", "steps=2"]
    assert main(train_args(tmp_path, arithmetic_jsonl, *ray)) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("proposer", "solver"):
        assert all(r[f"{name}/reward/samples"] == 4 for r in rows)
        assert [r[f"{name}/rollout/weight_version"] for r in rows] == [0.0, 1.0]
    assert ray_processes() == []
