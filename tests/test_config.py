from __future__ import annotations

import pytest

from postrl.cli import main
from postrl.config.loading import build_config, load_config
from postrl.config.run import ConfigError


def test_defaults_and_dotted_overrides():
    config = build_config({"data": {"task": "arithmetic"}}, ["train.lr=3e-4", "rollout.stop=['</answer>']", "steps=7"])
    assert config.train.lr == 3e-4 and config.rollout.stop == ["</answer>"] and config.steps == 7
    assert config.train.grad_clip == 1.0


def test_unknown_key_names_field_and_allowed_values():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["train.lrr=1e-4"])
    msg = str(err.value)
    assert "unknown config field 'train.lrr'" in msg and "allowed:" in msg and "lr," in msg


def test_bad_value_names_field_value_and_bound():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["train.lr=-1"])
    assert "'train.lr': got -1: Input should be greater than 0" in str(err.value)


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["data.on_bad_row=ignore"])
    msg = str(err.value)
    assert "data.on_bad_row" in msg and "'ignore'" in msg and "'error'" in msg and "'skip'" in msg


def test_unknown_algorithm_lists_registered_names():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["algorithm.advantage=gae2"])
    assert (
        "unknown advantage estimator 'gae2'; registered: dr_grpo, gae, grpo, reinforce_pp, "
        "reinforce_pp_baseline, remax, rloo"
    ) in str(err.value)
    with pytest.raises(ConfigError, match="unknown policy loss 'ppo2'; registered: cispo, gspo, ppo_clip, reinforce"):
        build_config({}, ["algorithm.policy_loss=ppo2"])
    with pytest.raises(ConfigError, match="algorithm.advantage=gae needs a critic"):
        build_config({}, ["algorithm.advantage=gae"])
    chosen = build_config(
        {},
        [
            "algorithm.advantage={type: reinforce_pp_baseline, gamma: 0.99}",
            "algorithm.policy_loss={type: ppo_clip, clip_eps_high: 0.28, dual_clip_c: 3}",
        ],
    ).algorithm
    assert chosen.advantage.options() == {"gamma": 0.99, "eps": 1e-8}
    assert chosen.policy_loss.options() == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": 3.0}


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="micro_batch_size=32 must be <= train.mini_batch_size=16"):
        build_config({}, ["train.mini_batch_size=16", "train.micro_batch_size=32"])
    with pytest.raises(ConfigError, match="duplicate names"):
        build_config({"reward": {"components": [{"name": "a", "type": "math"}, {"name": "a", "type": "exact_match"}]}})
    with pytest.raises(ConfigError, match="unknown task 'poetry'"):
        build_config({}, ["data.task=poetry"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        build_config({}, ["train.lr"])


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_cli_reports_config_error_before_any_work(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  epochs: 0\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "'train.epochs': got 0" in err and "greater than or equal to 1" in err
    assert not (tmp_path / "runs").exists()


def test_example_configs_are_valid():
    from pathlib import Path

    from postrl.config.dpo import DPORunConfig
    from postrl.config.run import RewardServiceFile
    from postrl.config.sft import SFTRunConfig

    examples = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml"))
    assert len(examples) >= 17
    for path in examples:
        if path.name.endswith("_service.yaml"):  # `postrl serve-reward --config` files
            assert load_config(path, model=RewardServiceFile).reward.components
        elif path.name == "dpo.yaml":  # `postrl dpo`
            assert load_config(path, model=DPORunConfig).dpo.loss_type == "sigmoid"
        elif path.name.startswith("sft"):  # `postrl sft`
            assert load_config(path, model=SFTRunConfig).data.train_files
        else:
            load_config(path)


def test_a_field_outside_reward_components_is_named_with_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"unknown config field 'reward.verifiable' \(allowed: .*components"):
        build_config({"reward": {"verifiable": {"type": "math"}}})


def test_scale_out_fields_are_checked_before_any_work():
    assert build_config({"scheduler": "ray"}).scheduler.type == "ray"  # `scheduler: ray` is short for {type: ray}
    with pytest.raises(ConfigError, match="rollout.weight_sync=broadcast sends weights to engines in other processes"):
        build_config({"rollout": {"weight_sync": "broadcast"}})
    assert build_config({"rollout": {"weight_sync": "broadcast"}, "scheduler": {"rollout": {"workers": 2}}})
    with pytest.raises(ConfigError, match="rollout.backend=openai needs rollout.url"):
        build_config({"rollout": {"backend": "openai"}})
    with pytest.raises(ConfigError, match="train.device"):
        build_config({"train": {"device": "gpu0"}})
    with pytest.raises(ConfigError, match="scheduler.rollout_schedule"):
        build_config({"scheduler": {"rollout_schedule": {0: 2}}})
    with pytest.raises(ConfigError, match="scheduler.train.workers"):
        build_config({"scheduler": {"train": {"workers": 0}}})


def test_a_cuda_device_this_machine_lacks_is_refused_by_train(tmp_path):
    import torch

    from postrl.run.train_runner import train

    wanted = "cuda:99" if torch.cuda.is_available() else "cuda"
    config = build_config({"output_dir": str(tmp_path), "train": {"device": wanted}})
    with pytest.raises(ConfigError, match=f"train.device={wanted}, but"):
        train(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("command", "field", "named"),
    [
        ("dpo", "train.precision=bf16_autocast", "is used by postrl train and postrl sft, not by postrl dpo"),
        ("dpo", "train.epochs=2", "is used by postrl train, not by postrl dpo"),
        ("dpo", "train.micro_batch_tokens=256", "is used by postrl train and postrl sft, not by postrl dpo"),
        ("dpo", "train.fused_head=false", "is used by postrl train and postrl sft, not by postrl dpo"),
        (
            "sft",
            "train.epochs=2",
            "is used by postrl train, not by postrl sft, which would ignore it: remove it (the top-level epochs is",
        ),
    ],
)
def test_a_field_the_command_would_ignore_is_refused_by_name(tmp_path, command, field, named):
    """postrl dpo used to ignore four train.* fields and an SFT config had two epochs: each command's
    train section now has only what it uses, and the refusal says the field is another command's."""
    from postrl.config.loading import command_models, load_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {train_files: [x.jsonl]}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), [field], model=command_models()[command])
    assert f"config field '{field.split('=')[0]}' {named}" in str(err.value)
    assert load_config(str(path), ["train.lr=0.001"], model=command_models()[command]).train.lr == 0.001
