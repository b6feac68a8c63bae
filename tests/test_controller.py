"""The Controller with small fake components: what it calls, in which order, with what."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.buffer import ExperienceBuffer
from postrl.config.loading import build_config
from postrl.controller.components import Components
from postrl.controller.controller import Controller
from postrl.controller.failures import RewardFailureError
from postrl.controller.source import SingleTurn
from postrl.data.dataset import PromptDataset
from postrl.data.prompt_source import GivenPrompts
from postrl.rollout.common import EngineBase, EngineUnhealthyError
from postrl.types import Health, Prompt, RewardResult, Rollout, TrainMetrics


class FakeRollout(EngineBase):
    def __init__(self, calls: list, healthy_after: int = 10**9) -> None:
        self.calls, self.healthy_after, self.syncs = calls, healthy_after, []
        self.engines = [self]
        self.restarts = self.sync_failures = 0

    def scale(self, engines):
        raise AssertionError("the fake rollout worker has one engine")

    def generate(self, prompts, sampling_params, weight_version):
        self.check_version(weight_version)
        self.calls.append(("generate", weight_version))
        return [
            Rollout(i, p.prompt_ids, [10 + k, 2], [-0.5, -0.25], f"{p.text}->{k}", "stop", weight_version)
            for i, p in enumerate(prompts)
            for k in range(sampling_params.n)
        ]

    def update_weights(self, weights, version, manifest=None):
        self.calls.append(("update_weights", version))
        self.syncs.append(version)
        self.weight_version = version

    def health_check(self):
        return self.health().ok

    def health(self):
        self.calls.append(("health_check", self.weight_version))
        if self.weight_version >= self.healthy_after:
            return Health(False, "KV cache holds NaN")
        return Health(True)


class FakeReward:
    """Rewards 1, 0, 1, 0, ...; the second sample of the first prompt is unscorable."""

    accuracy_component = None

    def __init__(self, calls: list, unscorable: set[int] = frozenset({1})) -> None:
        self.calls, self.unscorable = calls, unscorable

    def error_count(self):
        return 0

    def score_batch(self, requests):
        self.calls.append(("score", len(requests)))
        return [
            RewardResult(None, error="boom") if i in self.unscorable else RewardResult(float(i % 2 == 0))
            for i in range(len(requests))
        ]

    def close(self):
        pass


class FakeTrainer:
    def __init__(self, calls: list) -> None:
        self.calls, self.batches = calls, []

    def update(self, batch):
        self.calls.append(("update", batch.size))
        self.batches.append(batch)
        return TrainMetrics({"actor/loss": 0.1, "actor/kl": 0.0, "actor/grad_norm": 0.5, "actor/lr": 1e-5}, 1, 0)

    def policy_state(self):
        return {"w": torch.ones(2)}

    def set_kl_beta(self, beta):
        self.calls.append(("set_kl_beta", beta))


class Tokenizer:
    pad_token_id = 0


def controller(tmp_path, calls, algorithm=None, **kw) -> tuple[Controller, Components]:
    config = build_config(
        {
            "output_dir": str(tmp_path),
            "prompts_per_step": 2,
            "rollout": {"n": 2},
            "data": {"train_files": ["unused.jsonl"]},
            "reward": {"max_failure_rate": kw.pop("rate", 0.5)},
            "algorithm": algorithm or {},
        }
    )
    dataset = PromptDataset([Prompt(f"p{i}", [1, 5 + i]) for i in range(4)])
    rollout, reward = FakeRollout(calls, **kw), FakeReward(calls)
    parts = Components(
        config,
        Tokenizer(),
        GivenPrompts(dataset, config.data),
        rollout,
        reward,
        FakeTrainer(calls),
        ExperienceBuffer(),
        SingleTurn(rollout, reward, Tokenizer()),
    )
    ctl = Controller(parts)
    ctl.start()
    return ctl, parts


def test_step_calls_each_stage_once_in_order(tmp_path):
    calls: list = []
    ctl, parts = controller(tmp_path, calls)
    assert calls == [("update_weights", 0), ("health_check", 0)]  # the start: sync, then a health check
    metrics = ctl.step()
    assert calls[2:] == [("generate", 0), ("score", 4), ("update", 4), ("update_weights", 1), ("health_check", 1)]
    assert metrics.step == 1 and metrics.weight_version == 1 and ctl.weight_version == 1
    ctl.step()
    assert parts.rollout.syncs == [0, 1, 2]
    assert set(metrics.values) >= {"time/generate_s", "time/reward_s", "time/train_s", "time/sync_s", "time/step_s"}


def test_unscorable_sample_reaches_the_trainer_with_no_weight(tmp_path):
    calls: list = []
    ctl, parts = controller(tmp_path, calls)
    metrics = ctl.step()
    batch = parts.trainer.batches[0]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    # group 0: sample 0 scored 1, sample 1 unscorable -> one scorable sample: advantage 0, and no loss weight
    assert batch.advantages[1].abs().sum() == 0 and batch.loss_mask[1].sum() == 0
    assert batch.response_mask[1].sum() == 2  # still in the batch, in its group's context
    # group 1: rewards 1 and 0 -> +/- the same advantage on every response token
    a2, a3 = batch.advantages[2][batch.response_mask[2].bool()], batch.advantages[3][batch.response_mask[3].bool()]
    assert torch.allclose(a2, -a3) and a2[0] > 0 and math.isclose(float(a2[0]), 1 / (2**0.5 + 1e-6), rel_tol=1e-5)
    assert metrics.values["reward/unscorable"] == 1.0 and metrics.notes["unscorable_reason"] == "1x boom"


def test_failure_rate_stops_the_run_before_training(tmp_path):
    calls: list = []
    ctl, parts = controller(tmp_path, calls, rate=0.2)
    with pytest.raises(RewardFailureError, match=r"step 1: 1/4 samples could not be scored \(25% > "):
        ctl.step()
    assert ("update", 4) not in calls and (tmp_path / "run" / "unscored_step_1.jsonl").is_file()


def test_unhealthy_engine_stops_the_run_with_its_reason(tmp_path):
    calls: list = []
    ctl, _ = controller(tmp_path, calls, healthy_after=2)
    ctl.step()
    with pytest.raises(
        EngineUnhealthyError, match="health check after the weight sync to version 2: KV cache holds NaN"
    ):
        ctl.step()


def test_per_token_versions_from_the_engine_reach_the_trainer(tmp_path):
    calls: list = []
    ctl, parts = controller(tmp_path, calls)
    parts.buffer.max_staleness = 1
    ctl.step()  # now at version 1
    generate = parts.rollout.generate

    def across_an_update(prompts, sampling_params, weight_version):
        out = generate(prompts, sampling_params, weight_version)
        out[0].logprob_versions = [weight_version - 1, weight_version]  # token 1 came from older weights
        return out

    parts.rollout.generate = across_an_update
    metrics = ctl.step()
    versions = parts.trainer.batches[1].logprob_versions
    assert versions[0][versions[0] >= 0].tolist()[-2:] == [0, 1] and versions[1].max().item() == 1
    assert metrics.values["buffer/lag_max"] == 1.0 and metrics.values["buffer/lag_mean"] == 0.25


def test_dynamic_sampling_drops_uninformative_groups_and_samples_more(tmp_path):
    """Rewards by position: 1, 0, 1, 0, ... (FakeReward). With n=2 every group is [1, 0] (informative)
    unless a sample is unscorable: sample 1 of the first batch is, so its group has one score."""
    calls: list = []
    ctrl, parts = controller(tmp_path, calls, algorithm={"dynamic_sampling": True})
    metrics = ctrl.step()
    # round 1: groups [1, None] (dropped) and [1, 0]; one extra round of 2 prompts fills the step
    assert [c for c in calls if c[0] in ("generate", "score")] == [
        ("generate", 0),
        ("score", 4),
        ("generate", 0),
        ("score", 4),
    ]
    assert metrics.values["dapo/extra_rounds"] == 1 and metrics.values["dapo/dropped_groups"] == 2
    assert metrics.values["dapo/kept_groups"] == 2
    batch = parts.trainer.batches[0]
    assert batch.size == 4 and sorted(set(batch.group_ids.tolist())) == [0, 1]


def test_dynamic_sampling_stops_after_max_extra_rounds(tmp_path):
    calls: list = []
    ctrl, parts = controller(tmp_path, calls, algorithm={"dynamic_sampling": True, "max_extra_rounds": 2}, rate=1.0)
    parts.reward.unscorable = {1, 3}  # every group of every round has a single score: nothing informative
    metrics = ctrl.step()
    assert metrics.values["dapo/extra_rounds"] == 2 and metrics.values["dapo/kept_groups"] == 0
    assert parts.trainer.batches[0].size == 4  # the first batch, all advantages 0
    assert float(parts.trainer.batches[0].advantages.abs().sum()) == 0.0


def test_remax_generates_a_greedy_baseline_per_prompt_in_the_same_step(tmp_path):
    calls: list = []
    ctrl, parts = controller(tmp_path, calls, algorithm={"advantage": "remax"})
    parts.reward.unscorable = set()
    ctrl.step()
    # samples score 1, 0 | 1, 0; the greedy responses of the 2 prompts score 1 and 0
    assert [c for c in calls if c[0] in ("generate", "score")] == [
        ("generate", 0),
        ("score", 4),
        ("generate", 0),
        ("score", 2),
    ]
    batch = parts.trainer.batches[0]
    per_sample = (batch.advantages.sum(dim=1) / batch.response_mask.sum(dim=1)).tolist()
    assert per_sample == [0.0, -1.0, 1.0, 0.0]  # r - baseline: 1-1, 0-1, 1-0, 0-0


def test_a_resumed_controller_syncs_its_weights_once(tmp_path):
    calls: list = []
    ctl, parts = controller(tmp_path, calls)
    ctl.step()
    state = ctl.state_dict()
    resumed = Controller(parts)
    assert parts.rollout.syncs == [0, 1]  # building a Controller sends nothing
    resumed.start(state)
    assert parts.rollout.syncs == [0, 1, 1] and resumed.weight_version == 1  # one sync, of the resumed version


def test_samples_file_carries_each_samples_advantage_and_metadata(tmp_path):
    import json

    calls: list = []
    ctl, _ = controller(tmp_path, calls)
    ctl.step()
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert [r["advantage"] for r in rows][1] == 0.0 and rows[2]["advantage"] == pytest.approx(1 / (2**0.5 + 1e-6))
    meta = rows[0]["metadata"]
    assert set(meta) == {"task_type", "engine", "batch", "row", "generated_at", "scored_at"}
    assert meta["task_type"] is None and meta["scored_at"] >= meta["generated_at"] > 0
    assert (meta["batch"], meta["row"], rows[3]["metadata"]["row"]) == (1, 0, 3)


def test_closing_the_components_closes_every_worker_and_then_the_scheduler():
    from postrl.run.train_job import close_components

    closed: list[str] = []

    class Part:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)

    parts = Components(
        None,
        Tokenizer(),
        None,
        Part("rollout"),
        Part("reward"),
        Part("trainer"),
        None,
        None,
        Part("scheduler"),
        Part("critic"),
    )  # type: ignore[arg-type]
    close_components(parts)
    assert closed == ["reward", "rollout", "trainer", "critic", "scheduler"]
