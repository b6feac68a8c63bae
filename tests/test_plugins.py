"""Issue 9: a user registers their own advantage estimator and loss from a module named in the config."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from postrl.cli import main
from postrl.config.loading import load_config
from postrl.config.run import ConfigError
from tests.test_train_e2e import write_config

PLUGIN = textwrap.dedent("""
    import torch
    from postrl.algorithms import register_advantage, register_policy_loss, PolicyLossOutput, TokenMetric

    CALLS = []

    @register_advantage("centered_plugin", needs_groups=True)
    def centered(inputs):
        CALLS.append("advantage")
        r = torch.nan_to_num(inputs.rewards, nan=0.0)
        return r - r.mean()

    @register_policy_loss("reinforce_plugin")
    def reinforce(inputs):
        CALLS.append("loss")
        adv = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
        return PolicyLossOutput(per_token=-inputs.logprobs * adv * inputs.mask,
                                metrics={"plugin/tokens": TokenMetric(inputs.mask, "sum")})
""")


@pytest.fixture
def scratch_registries(monkeypatch):
    """The plugin's registrations vanish after the test, so other tests see the built-in registries."""
    import sys

    from postrl.algorithms import ADVANTAGES, POLICY_LOSSES, STAGES

    for registry in (ADVANTAGES, POLICY_LOSSES, STAGES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    monkeypatch.setattr(ADVANTAGES, "_needs", dict(ADVANTAGES._needs))
    yield
    sys.modules.pop("my_algos", None)


def test_plugin_module_next_to_the_config_registers_algorithms(
    tmp_path, tiny_model_dir, arithmetic_jsonl, scratch_registries
):
    (tmp_path / "my_algos.py").write_text(PLUGIN)
    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        steps=1,
        algorithm={"plugins": ["my_algos"], "advantage": "centered_plugin", "policy_loss": "reinforce_plugin"},
    )
    assert main(["train", config]) == 0
    import my_algos

    assert my_algos.CALLS[0] == "advantage" and "loss" in my_algos.CALLS
    row = json.loads((tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()[0])
    # the loss's own metric, summed over the update: every trained token (4 prompts x 4 samples)
    assert row["plugin/tokens"] == row["response/length_mean"] * 16
    # the estimator was registered as a group baseline, so n=1 is refused like GRPO
    with pytest.raises(ConfigError, match="algorithm.advantage=centered_plugin compares the samples of a prompt"):
        load_config(config, ["rollout.n=1"])


def test_a_plugin_that_does_not_import_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"algorithm": {"plugins": ["no_such_algos"], "advantage": "x"}}))
    with pytest.raises(ConfigError, match="algorithm.plugins: cannot import 'no_such_algos'"):
        load_config(path)


STAGE_PLUGIN = textwrap.dedent("""
    from postrl.algorithms import register_stage
    from postrl.controller.stages import Stage

    @register_stage("response_share")
    class ResponseShare(Stage):
        '''The share of the step's tokens that are response tokens, and a running count of steps.'''

        name = "response_share"
        phases = ("prepare", "after_update")

        def __init__(self, context, scale=1.0):
            self.scale, self.steps = scale, 0

        def prepare(self, step):
            b = step.batch
            return {"stage/response_share": self.scale * float(b.response_mask.sum() / b.attention_mask.sum())}

        def after_update(self, batch, train):
            self.steps += 1
            return {"stage/steps_seen": float(self.steps)}

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]
""")


def test_a_stage_from_a_users_module_runs_in_the_step_and_resumes(
    tmp_path, tiny_model_dir, arithmetic_jsonl, scratch_registries
):
    (tmp_path / "my_stages.py").write_text(STAGE_PLUGIN)
    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        steps=2,
        algorithm={"plugins": ["my_stages"], "stages": [{"type": "response_share", "params": {"scale": 100.0}}]},
    )
    assert main(["train", config]) == 0
    run = tmp_path / "runs" / "tiny"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage/steps_seen"] for r in rows] == [1.0, 2.0]
    assert all(0 < r["stage/response_share"] < 100 for r in rows) and "time/response_share_s" in rows[0]
    assert main(["train", "--resume", str(run), "steps=3"]) == 0  # the stage's count comes back from the checkpoint
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage/steps_seen"] for r in rows] == [1.0, 2.0, 3.0]


def test_an_unknown_stage_is_named_with_the_registered_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"algorithm": {"stages": [{"type": "nope"}]}}))
    with pytest.raises(ConfigError, match=r"algorithm.stages\[0\]: unknown stage 'nope'"):
        load_config(path)


def test_a_stage_whose_needs_the_run_lacks_is_refused_by_name(scratch_registries):
    from postrl.algorithms import register_stage
    from postrl.config.loading import build_config
    from postrl.controller.stages import Stage, StageContext, build_stages
    from postrl.controller.stages.kl import KLCoefficient

    @register_stage("value_report")
    class ValueReport(Stage):
        name = "value_report"
        phases = ("prepare",)
        needs = frozenset({"critic"})

        def __init__(self, context):
            pass

    config = build_config({"algorithm": {"stages": [{"type": "value_report"}]}})
    context = StageContext(config, None, None, None, KLCoefficient(0.0, None))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the value_report stage needs critic: set algorithm.critic"):
        build_stages(context)
