"""The Ray scheduler on a real local Ray cluster: a 3-step run through the same Controller, a
rollout actor killed in the middle of a step, and no process left behind."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

os.environ["RAY_AUTH_MODE"] = "disabled"
ray = pytest.importorskip("ray")

from postrl.config.loading import build_config  # noqa: E402
from postrl.config.observability import PrometheusConfig  # noqa: E402
from postrl.controller.overlap import resolve_overlap  # noqa: E402
from postrl.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from postrl.models.weights import dedupe_tied, weight_manifest  # noqa: E402
from postrl.reward.factory import make_reward_service  # noqa: E402
from postrl.rollout.factory import EngineSpec  # noqa: E402
from postrl.run.train_runner import train  # noqa: E402
from postrl.scheduling.ray_scheduler import RayScheduler  # noqa: E402
from postrl.types import (  # noqa: E402
    Prompt,
    SamplingParams,
    ScoreRequest,  # noqa: E402
)
from tests.conftest import TEST_PROCESS_MARK  # noqa: E402
from tests.engine_hosts import SlowHost  # noqa: E402
from tests.trained_samples import record_trained_samples  # noqa: E402

# Ray clusters, benchmark runs, whole CLI sessions: not in the fast tier; one xdist worker runs them all
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def ray_processes() -> list[str]:
    """Running Ray processes this test process started, itself or through its children (zombies
    already exited: they only wait to be reaped). Each carries the test process's mark in its
    environment (tests/conftest.py), as Ray's processes inherit the driver's: another xdist
    worker's Ray instance is not counted."""
    mark = f"{TEST_PROCESS_MARK}={os.environ[TEST_PROCESS_MARK]}".encode()
    out = subprocess.run(["ps", "-ww", "-eo", "stat=,pid=,args="], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if any(k in line for k in ("gcs_server", "raylet", "ray::")) and not line.startswith("Z")
        if mark in environment(int(line.split()[1]))
    ]


def environment(pid: int) -> list[bytes]:
    """A process's environment entries (none where it is gone or not readable)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def ray_config(tmp_path, model_dir, data, **scheduler):
    return build_config(
        {
            "name": "ray",
            "output_dir": str(tmp_path),
            "steps": 3,
            "prompts_per_step": 4,
            "model": {"path": str(model_dir)},
            "data": {"train_files": [str(data)]},
            "rollout": {"n": 4, "max_tokens": 8, "device": "cpu"},
            "reward": {
                "components": [
                    {"type": "math", "name": "acc"},
                    {"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"},
                ]
            },
            "train": {"mini_batch_size": 16, "micro_batch_size": 8, "device": "cpu"},
            "checkpoint": {"every_steps": 2},
            "logging": {"trackers": ["jsonl"]},
            "scheduler": {"type": "ray", "rollout": {"workers": 2, "threads": 1}, "train": {"threads": 1}, **scheduler},
        }
    )


def test_three_step_ray_run_then_nothing_left_running(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """Also: the Controller's Prometheus endpoint shows the actors' figures (the train actor's peak
    memory, the two rollout actors, the reward service's errors) while the run goes on."""
    import socket
    import urllib.request

    assert not ray.is_initialized() and not ray_processes()
    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config.logging.prometheus = PrometheusConfig(port=port)
    scraped: list[str] = []

    def scrape(metrics) -> None:  # observers run before the sinks: step 3 sees step 2's series
        if metrics.step == 3:
            scraped.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())

    controller = train(config, on_step=scrape).controller
    series = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in scraped[0].splitlines() if line.startswith("postrl_")
    }
    assert series['postrl_step{run="ray"}'] == 2 and series['postrl_engines{run="ray"}'] == 2
    assert series['postrl_peak_memory_bytes{role="train",run="ray"}'] > 0
    assert series['postrl_reward_service_errors_total{run="ray"}'] == 0
    assert series['postrl_engine_healthy{run="ray"}'] == 1
    assert controller.step_count == 3 and controller.weight_version == 3
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["weight_version"] == r["step"] for r in rows)
    assert len(controller.parts.rollout.engines) == 2
    # the trained weights came back from the train actor and load as a model
    final = load_causal_lm(str(config.run_dir / "final_model"))
    start = load_causal_lm(str(tiny_model_dir))
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), start.state_dict().values()))
    assert (config.run_dir / "checkpoints" / "step_00000003" / "COMPLETE").is_file()
    # the run started its own Ray instance and shut it down: no driver connection, no process left
    assert not ray.is_initialized()
    assert ray_processes() == []


def test_rollout_actor_killed_mid_step_loses_and_duplicates_nothing(tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    scheduler = RayScheduler(config.scheduler, config.import_paths)
    try:
        tokenizer = load_tokenizer(str(tiny_model_dir))
        pool = scheduler.rollout_pool(EngineSpec.of_run(config), tokenizer, host_class=SlowHost)  # answers after 1.5 s
        state = dedupe_tied(load_causal_lm(str(tiny_model_dir)).state_dict())
        pool.update_weights(state, 1, weight_manifest(state))
        prompts = [Prompt(t, tokenizer(t)["input_ids"]) for t in [f"{a}+{a}=" for a in range(10, 26)]]
        sp = SamplingParams(n=8, temperature=1.0, max_tokens=20)
        victim = pool.engines[1].handle
        threading.Timer(0.7, victim.kill).start()
        out = pool.generate(prompts, sp, 1)
        assert pool.restarts == 1 and pool.requeued_prompts == 8
        assert [r.prompt_index for r in out] == [i for i in range(16) for _ in range(8)]
        assert all(r.weight_version == 1 for r in out)
        assert [slot.handle.attribute("weight_version") for slot in pool.engines] == [1, 1]
        pool.close()
        # the Reward Service actor dies: it is started again and the batch scored again
        reward = scheduler.reward_service(make_reward_service, config.reward)
        requests = [ScoreRequest("1+1=", "22", {}, 2), ScoreRequest("1+1=", "a", {}, 1)]
        want = [r.components for r in reward.score_batch(requests)]
        reward.handle.kill()
        assert (
            [r.components for r in reward.score_batch(requests)]
            == want
            == [{"acc": 0.0, "digits": 1.0}, {"acc": 0.0, "digits": 0.0}]
        )
        assert reward.restarts == 1
        reward.close()
    finally:
        scheduler.close()
    assert not ray.is_initialized()


def test_ppo_with_critic_and_kl_in_the_reward_under_ray(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """The critic as its own actor, reference log-probabilities from the train actor, an adaptive KL
    coefficient sent to it: the algorithm library runs under the Ray scheduler too."""
    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    config = build_config(
        {
            **config.model_dump(mode="json"),
            "steps": 2,
            "algorithm": {
                "advantage": "gae",
                "critic": {"lr": 1e-2},
                "kl_beta": 0.1,
                "kl_in": "reward",
                "kl_target": 0.01,
            },
        }
    )
    controller = train(config).controller
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["critic/value_loss"] > 0 for r in rows) and rows[1]["kl/reward_penalty"] > 0
    assert rows[1]["actor/kl_beta"] != 0.1
    assert (config.run_dir / "checkpoints" / "step_00000002" / "critic" / "optimization.pt").is_file()
    assert not ray.is_initialized() and controller.step_count == 2


def test_async_run_under_ray_overlaps_generation_and_leaves_nothing_running(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from postrl.config.off_policy import BufferConfig, ControllerConfig

    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl)
    config.steps = 4
    config.buffer = BufferConfig(max_staleness=1)
    config.controller = ControllerConfig(mode="async")
    assert resolve_overlap(config).runs == "generation"  # auto: the producer thread drives the rollout actors
    controller = train(config).controller
    assert controller.step_count == 4 and controller.weight_version == 4
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["buffer/lag_max"] for r in rows) <= 1 and rows[-1]["buffer/lag_max"] == 1.0
    from postrl.controller.async_pipelines import ThreadedPipeline
    from postrl.scheduling.ray_actors import RayHandle
    from postrl.workers.clients import RoleClient

    buffer = controller.parts.buffer  # the Experience Buffer was an actor of its own
    assert isinstance(buffer, RoleClient) and isinstance(buffer.handle, RayHandle)
    assert isinstance(controller.pipeline, ThreadedPipeline) and not controller.pipeline.producer.alive()
    assert not ray.is_initialized()
    assert ray_processes() == []


def test_async_on_two_nodes_losing_the_generation_node_loses_and_repeats_no_sample(
    tmp_path, tiny_model_dir, arithmetic_jsonl, monkeypatch
):
    """Two raylets on this machine: generation on one (resource gen_node), training and scoring on
    the other. The generation node is removed in the middle of the run and a new one added: the
    engine is placed again, and every sample of every batch is trained exactly once."""
    from ray.cluster_utils import Cluster

    from postrl.config.off_policy import BufferConfig, ControllerConfig
    from postrl.workers.clients import client_class
    from postrl.workers.roles import ExperienceStore

    trained = record_trained_samples(
        monkeypatch, client_class(ExperienceStore)
    )  # the buffer is an actor: what reaches the trainer
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"train_node": 4}})
    generation = cluster.add_node(num_cpus=2, resources={"gen_node": 1})
    cluster.wait_for_nodes()
    try:
        config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl, address=cluster.address)
        config.steps = 8
        config.checkpoint.every_steps = 0
        config.scheduler.rollout.workers = 1
        config.scheduler.rollout.resources = {"gen_node": 1}
        config.scheduler.train.resources = {"train_node": 1}
        config.scheduler.reward.resources = {"train_node": 1}
        config.scheduler.buffer.resources = {"train_node": 1}  # the buffer outlives the generation node
        config.buffer = BufferConfig(max_staleness=1)
        config.controller = ControllerConfig(mode="async")
        moved: list = []

        def lose_the_generation_node(metrics):
            if metrics.step == 3 and not moved:
                cluster.remove_node(generation)
                moved.append(cluster.add_node(num_cpus=2, resources={"gen_node": 1}))

        controller = train(config, on_step=lose_the_generation_node).controller
        assert moved and controller.parts.rollout.restarts >= 1
        assert sorted(trained) == list(range(1, 9))
        ids = [s for step in sorted(trained) for s in trained[step]]
        assert len(ids) == len(set(ids)) == 8 * 16 and {b for b, _ in ids} == set(range(1, 9))
        rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert max(r["buffer/lag_max"] for r in rows) <= 1
    finally:
        cluster.shutdown()
        for _ in range(100):  # the raylets' helpers exit a moment after the shutdown
            if not ray_processes():
                break
            time.sleep(0.2)


def test_rollout_actors_take_weights_mid_generate_and_suspend_when_asked(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """A rollout engine's actor is threaded: new weights sent while it generates are swapped in at
    its next decode step (the tokens after carry the new version), and a suspend stops the generate
    (its samples come back suspended) instead of waiting behind it."""
    config = ray_config(tmp_path, tiny_model_dir, arithmetic_jsonl, rollout={"workers": 1, "threads": 1})
    scheduler = RayScheduler(config.scheduler, config.import_paths)
    try:
        tokenizer = load_tokenizer(str(tiny_model_dir))
        pool = scheduler.rollout_pool(EngineSpec.of_run(config), tokenizer)
        assert pool.engines[0].handle.concurrent
        state = dedupe_tied(load_causal_lm(str(tiny_model_dir)).state_dict())
        pool.update_weights(state, 1)
        prompts = [Prompt(t, tokenizer(t)["input_ids"]) for t in [f"{a}+{a}=" for a in range(10, 26)]]
        long = SamplingParams(n=8, temperature=1.0, max_tokens=100, stop_token_ids=())
        newer = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}
        crossed = []
        for _ in range(3):  # new weights go out for as long as the generate runs, so some land mid-batch
            out: dict = {}
            thread = threading.Thread(target=lambda out=out: out.update(r=pool.generate(prompts, long, None)))
            thread.start()
            sent = 0
            while thread.is_alive():
                pool.update_weights(newer if sent % 2 == 0 else state, pool.weight_version + 1)
                sent += 1
            thread.join(120)
            crossed = [r for r in out["r"] if r.logprob_versions and len(set(r.logprob_versions)) > 1]
            if crossed:
                break
        assert all(list(r.logprob_versions) == sorted(r.logprob_versions) for r in crossed)
        assert crossed, "the weights never arrived during a generate"
        out = {}
        thread = threading.Thread(target=lambda: out.update(r=pool.generate(prompts, long, None)))
        thread.start()
        while thread.is_alive() and not pool.suspend():
            time.sleep(0.01)
        thread.join(120)
        suspended = [r for r in out["r"] if r.finish_reason == "suspended"]
        assert suspended and all(len(r.response_ids) < 100 for r in suspended)
    finally:
        scheduler.close()


def test_postrl_dpo_on_a_ray_actor_trains_as_in_process(tmp_path, tiny_model_dir, monkeypatch):
    """DPO is placed by the same schedulers: under Ray its reference and its trainer are actors, and
    the run's losses are the in-process run's; nothing is left running."""
    from postrl.cli import main

    placed: list[str] = []
    actor = RayScheduler._actor

    def recording(self, name, *args, **kwargs):
        placed.append(name)
        return actor(self, name, *args, **kwargs)

    monkeypatch.setattr(RayScheduler, "_actor", recording)

    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(10, 18)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses = {}
    for kind in ("local", "ray"):
        config = tmp_path / f"{kind}.yaml"
        config.write_text(
            f"name: {kind}\noutput_dir: {tmp_path}/runs\nmodel: {{path: {tiny_model_dir}}}\n"
            f"data: {{train_files: [{data}]}}\ndpo: {{beta: 0.5}}\n"
            "train: {lr: 1.0e-2, mini_batch_size: 4, micro_batch_size: 4}\n"
            f"logging: {{trackers: [jsonl]}}\nscheduler: {{type: {kind}, train: {{threads: 1}}}}\n"
        )
        assert main(["dpo", str(config)]) == 0
        metrics = (tmp_path / "runs" / kind / "metrics.jsonl").read_text().splitlines()
        losses[kind] = [json.loads(line)["dpo/loss"] for line in metrics]
    assert placed == ["dpo trainer", "dpo trainer"]  # the reference (closed), then the trainer
    assert len(losses["ray"]) == 2 and losses["ray"] == pytest.approx(losses["local"], abs=1e-6)
    assert not ray.is_initialized() and ray_processes() == []
