"""Issue 15 (a user's second day): what a resume may change, checks that happen before anything is
written, and a run directory whose launch never completed a step."""

from __future__ import annotations

import json

import pytest
import torch

from postrl.cli import main
from postrl.config.resume_policy import check_resume_changes, flatten
from postrl.config.run import ConfigError, RewardConfig
from postrl.reward.columns import check_columns, function_columns
from postrl.run.metrics import read_metrics
from tests.test_train_e2e import write_config


def test_flatten_and_the_policy_per_field():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}
    check_resume_changes(
        [
            ("steps", 3, 6),
            ("logging.console", True, False),
            ("scheduler.train.workers", 1, 2),
            ("reward.timeout_s", 5.0, 9.0),
        ],
        [],
        "runs/x",
    )
    with pytest.raises(ConfigError) as err:
        check_resume_changes([("model.path", "a", "b"), ("seed", 1, 2), ("steps", 3, 6)], [], "runs/x")
    assert str(err.value).splitlines()[:3] == [
        "--resume runs/x would change what defines the run:",
        "  model.path: 'a' -> 'b'",
        "  seed: 1 -> 2",
    ]
    assert "--force-change model.path --force-change seed" in str(err.value)
    check_resume_changes([("model.path", "a", "b")], ["model"], "runs/x")  # a section name forces all of it
    with pytest.raises(ConfigError, match="--force-change train.lr: no such change"):
        check_resume_changes([("steps", 3, 6)], ["train.lr"], "runs/x")


def test_resume_refuses_a_new_model_and_fewer_steps(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=2)
    assert main(["train", config]) == 0
    run = tmp_path / "runs" / "tiny"
    saved = (run / "config.yaml").read_text()
    final = (run / "final_model" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "model.path=demo"]) == 2
    err = capsys.readouterr().err
    assert f"model.path: '{tiny_model_dir}' -> 'demo'" in err and "--force-change model.path" in err
    assert main(["train", "--resume", str(run), "steps=1"]) == 2
    assert "steps=1 is below the 2 this run has already done" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == saved  # nothing was rewritten
    assert (run / "final_model" / "model.safetensors").read_bytes() == final
    assert main(["train", "--resume", str(run), "steps=3", "logging.console=false"]) == 0
    err = capsys.readouterr().err
    assert "resume changes: logging.console True -> False; steps 2 -> 3" in err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    # forced on purpose: the change is taken and recorded
    assert main(["train", "--resume", str(run), "steps=4", "train.lr=0.002", "--force-change", "train.lr"]) == 0
    assert "train.lr 0.001 -> 0.002" in capsys.readouterr().err
    assert "lr: 0.002" in (run / "config.yaml").read_text()


def _columns(rows):
    return [(f"data.jsonl:{i + 1}", row) for i, row in enumerate(rows)]


def test_reward_columns_are_checked_against_the_data():
    assert function_columns("tests.reward_fns:digit_share") == []
    exact = RewardConfig(components=[{"type": "exact_match", "name": "acc"}])
    check_columns(exact, _columns([{"answer": "1"}]))
    with pytest.raises(ConfigError) as err:
        check_columns(exact, _columns([{"answer": "1"}, {"x": 1}, {"x": 2}, {}, {}, {}]))
    assert (
        "reward component 'acc' (exact_match): it reads 'answer', missing in data.jsonl:2, data.jsonl:3, "
        "data.jsonl:4 and 2 more"
    ) in str(err.value)
    scoped = RewardConfig(components=[{"type": "math", "name": "m", "applies_to": ["math"]}])
    check_columns(scoped, _columns([{"task_type": "code"}]))  # the component does not apply to that row


def test_custom_function_parameters_are_columns(tmp_path, monkeypatch):
    (tmp_path / "subtract_rewards.py").write_text(
        "def score(prompt, response, answer, *, strict=False):\n    return float(response.strip() == answer)\n"
        "def loose(prompt, response, **columns):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert function_columns("subtract_rewards:score") == ["answer"]
    assert function_columns("subtract_rewards:loose") == []
    config = RewardConfig(components=[{"type": "custom", "name": "s", "function": "subtract_rewards:score"}])
    with pytest.raises(ConfigError, match="subtract_rewards:score takes 'answer', missing in data.jsonl:1"):
        check_columns(config, _columns([{"expected": "3"}]))


def test_a_failed_launch_writes_nothing_and_a_relaunch_reuses_its_directory(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "sub.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{a}-{b}=", "result": str(a - b)}) + "\n"
            for a in range(20, 24)
            for b in range(10, 14)
        )
    )
    config = write_config(tmp_path, tiny_model_dir, data, steps=1)
    assert main(["train", config]) == 2
    assert "it reads 'answer', missing in" in capsys.readouterr().err
    run = tmp_path / "runs" / "tiny"
    assert not run.exists()
    # the leftovers of a launch that died before step 1 (as an older postrl, or a crash, left them)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(open(config).read())
    (run / "reward_workers.log").write_text("")
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    assert "it never completed a step, so start it again with the same command" in capsys.readouterr().err
    fixed = ["reward.components=[{name: acc, type: exact_match, answer_column: result}]"]
    assert main(["train", config, *fixed]) == 0
    assert f"reusing {run}: it held only the leftovers of a launch that completed no step" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]


def test_an_unreachable_rollout_url_is_refused_before_anything_is_written(
    tmp_path, tiny_model_dir, arithmetic_jsonl, capsys
):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=1)
    args = [
        "train",
        config,
        "rollout.backend=openai",
        "rollout.url=http://127.0.0.1:1/v1",
        f"rollout.sync_dir={tmp_path}",
    ]
    assert main(args) == 2
    assert (
        "rollout.url=http://127.0.0.1:1/v1 cannot be reached (Connection refused); start the server first"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "runs" / "tiny").exists()


def test_vllm_max_model_len_defaults_to_what_the_run_needs(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """The default used to be 2048, which vLLM refuses for a 128-token model only after its start-up."""
    from postrl.config.loading import build_config
    from postrl.run.resolve import resolved_run

    base = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_files": [str(arithmetic_jsonl)]},
        "rollout": {"backend": "vllm", "max_tokens": 16},
    }
    given = build_config(base)
    config = resolved_run(given)
    assert config.rollout.vllm.max_model_len == 128 and config.data.max_prompt_tokens == 112
    assert given.rollout.vllm.max_model_len is None and given.data.max_prompt_tokens is None  # left as it was
    config = resolved_run(build_config(base, ["data.max_prompt_tokens=40"]))
    assert config.rollout.vllm.max_model_len == 56
    with pytest.raises(
        ConfigError, match="rollout.vllm.max_model_len=2048 is more than the model's context length 128"
    ):
        resolved_run(build_config(base, ["rollout.vllm.max_model_len=2048"]))
    with pytest.raises(ConfigError, match="rollout.vllm.max_model_len=32 is less than"):
        resolved_run(build_config(base, ["rollout.vllm.max_model_len=32"]))


def test_validation_progress_and_no_signal_in_a_run(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(30, 35)))
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=3)
    # exact_match on a random model: every sample wrong, every group without signal
    assert main(["train", config, f"data.val_files=[{val}]", "logging.eval_every=2"]) == 0
    out = capsys.readouterr()
    rows = read_metrics(tmp_path / "runs" / "tiny" / "metrics.jsonl")
    assert [("val/accuracy" in r) for r in rows] == [False, True, True]  # every 2 steps and at the end
    assert all(r["val/prompts"] == 5.0 and r["val/accuracy"] == 0.0 for r in rows[1:])
    assert [r["reward/no_signal_groups"] for r in rows] == [1.0, 1.0, 1.0]
    lines = [line for line in out.out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "left" in lines[0] and "elapsed" in lines[2] and "left" not in lines[2]
    assert "val acc 0.000" in lines[1] and "100% of groups have identical rewards" in lines[0]
    assert "in the last 3 steps every group's samples got identical rewards" in out.err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs" / "tiny" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/accuracy")] == [2, 3]


def test_eval_every_without_held_out_prompts_is_refused(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=1)
    assert main(["train", config, "logging.eval_every=1"]) == 2
    assert "logging.eval_every=1 needs held-out prompts: set data.val_files" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "tiny").exists()


def test_a_data_path_on_the_command_line_is_found_next_to_the_config(
    tmp_path, tiny_model_dir, arithmetic_jsonl, monkeypatch, capsys
):
    from postrl.config.loading import load_config

    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_config(config, ["data.train_files=[train.jsonl]"])
    assert loaded.data.train_files == [str(tmp_path / "train.jsonl")]
    assert main(["train", config, "data.val_files=[nope.jsonl]", "logging.eval_every=1"]) == 2
    assert (
        f"dataset file nope.jsonl does not exist (a relative path is looked up in the working directory "
        f"{elsewhere}, then next to the config file)"
    ) in capsys.readouterr().err


@pytest.mark.slow
def test_eval_of_a_run_uses_its_own_held_out_data_and_works_for_url_runs(
    tmp_path, tiny_model_dir, arithmetic_jsonl, capsys, monkeypatch
):
    monkeypatch.setenv("POSTRL_RUN_CACHE", str(tmp_path / "cache"))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(40, 46)))
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=1)
    assert main(["train", config, f"data.val_files=[{val}]"]) == 0
    capsys.readouterr()
    run = tmp_path / "runs" / "tiny"
    assert main(["eval", "--run", str(run)]) == 0
    assert "val.jsonl: accuracy 0.000 (0/6)" in capsys.readouterr().out
    # a run on its own files without held-out ones: told what to pass, not scored on the addition task
    assert main(["train", config, "name=plain"]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "runs" / "plain")]) == 2
    assert f"trained on {arithmetic_jsonl}, which has no built-in held-out split: pass --data FILE" in (
        capsys.readouterr().err
    )
    # a run kept at a URL evaluates like a local one
    url = f"file://{tmp_path / 'remote'}"
    assert main(["train", config, f"output_dir={url}", "name=far", f"data.val_files=[{val}]"]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", f"{url}/far"]) == 0
    assert "val.jsonl: accuracy 0.000 (0/6)" in capsys.readouterr().out


def test_errors_name_the_fields_the_user_wrote_and_the_file():
    from postrl.config.loading import build_config, load_config

    with pytest.raises(ConfigError) as err:
        build_config({}, ["reward.components=[{type: custom, name: a, function: 'x:y', wieght: 1}]"])
    lines = str(err.value).splitlines()
    assert (
        "  unknown config field 'reward.components.0.wieght' (allowed: "
        "accuracy, applies_to, expected_range, function, name, timeout_s, type, weight)"
    ) in lines
    assert any("'reward.components.0.function': function='x:y': no module named 'x'" in line for line in lines)
    with pytest.raises(ConfigError, match=r"config field 'algorithm.advantage.type': unknown advantage estimator"):
        build_config({}, ["algorithm.advantage={type: my_plugin}"])
    with pytest.raises(ConfigError, match=r"config field 'reward.components.0.name' is required"):
        build_config({}, ["reward.components=[{type: math}]"])
    import os

    examples = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")
    with pytest.raises(
        ConfigError,
        match=r"is a `postrl train` config \(it has algorithm, prompts_per_step, reward, "
        r"rollout, steps\), not a `postrl dpo` one",
    ):
        from postrl.config.dpo import DPORunConfig

        load_config(os.path.join(examples, "arithmetic_grpo.yaml"), model=DPORunConfig)


def test_a_yaml_syntax_error_and_a_corrupt_parquet_file_name_the_file(tmp_path, tiny_model_dir, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nmodel: {path: demo\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"in {bad}, line 2, column 8" in err and "<unicode string>" not in err
    broken = tmp_path / "rows.parquet"
    broken.write_bytes(b"PAR1 not really parquet PAR1")
    config = write_config(tmp_path, tiny_model_dir, broken, steps=1)
    assert main(["train", config]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"postrl train: error: dataset file {broken} is not a readable Parquet file: "
    )


def test_a_large_logprob_mismatch_is_warned_once_naming_both_dtypes():
    from postrl.config.loading import build_config
    from postrl.run.watch import MismatchWatch
    from postrl.types import StepMetrics

    config = build_config({}, ["rollout.backend=openai", "rollout.url=http://127.0.0.1:8200", "rollout.sync_dir=/tmp"])
    said: list[str] = []
    watch = MismatchWatch(config, said.append)
    watch.observe(StepMetrics(1, 1, {"rollout/logprob_diff_max": 0.2, "rollout/mismatch_kl": 0.001}))
    assert said == []
    watch.observe(StepMetrics(2, 2, {"rollout/logprob_diff_max": 1.17, "rollout/mismatch_kl": 0.03}))
    watch.observe(StepMetrics(3, 3, {"rollout/logprob_diff_max": 1.5, "rollout/mismatch_kl": 0.05}))
    assert said == [
        "warning: at step 2 the rollout's logprobs differ from the trainer's by up to 1.17 (mismatch KL 0.0300): "
        "rollouts come from the rollout servers at http://127.0.0.1:8200 (in the dtype they were started with: "
        "serve-rollout --dtype), the trainer computes in float32. The policy ratio then "
        "mixes two policies; start the servers with `postrl serve-rollout --dtype float32` (and "
        "train.precision=float32 on a GPU) so both compute alike in float32; or train.precision=bf16_autocast "
        "brings the trainer closer to a bf16 engine"
    ]
    # a setting already in force is never the advice (the issue-43 run was told to set the bf16 autocast it had)
    both_bf16 = build_config({}, ["rollout.dtype=bfloat16", "train.precision=bf16_autocast"])
    said.clear()
    MismatchWatch(both_bf16, said.append).observe(StepMetrics(2, 2, {"rollout/logprob_diff_max": 0.54}))
    exact_fix = (
        "set rollout.exact=true (with rollout.dtype=bfloat16 and train.precision=bf16_autocast, or both float32): "
        "engine and trainer then compute every logprob alike, bit for bit"
    )
    assert said[0].endswith(
        f"the trainer computes in bf16 autocast. The policy ratio then mixes two policies; {exact_fix}; or set "
        "rollout.dtype=float32 and train.precision=float32 so both compute alike in float32"
    )
    fp32 = build_config({}, ["rollout.dtype=float32", "train.precision=float32", "algorithm.old_logprobs=rollout"])
    said.clear()
    MismatchWatch(fp32, said.append).observe(StepMetrics(2, 2, {"rollout/logprob_diff_max": 0.54}))
    assert said[0].endswith(
        f"mixes two policies; {exact_fix}; or algorithm.old_logprobs=recompute corrects the gap with importance weights"
    )
    # with exact mode on, a gap is not a precision question: the advice says what else it can be
    exact = build_config({}, ["rollout.exact=true", "rollout.dtype=bfloat16", "train.precision=bf16_autocast"])
    said.clear()
    MismatchWatch(exact, said.append).observe(StepMetrics(2, 2, {"rollout/logprob_diff_max": 0.54}))
    assert said[0].endswith(
        "a gap means the weights differ (check the weight sync, rollout.kv_after_update=recompute) or samples "
        "lag the trainer"
    )
    # samples that lag the trainer by design differ from it by the lag: nothing to say about precision
    lagging = build_config({}, ["controller.mode=async", "buffer.max_staleness=1"])
    said.clear()
    MismatchWatch(lagging, said.append).observe(StepMetrics(2, 2, {"rollout/logprob_diff_max": 1.17}))
    assert said == []


@pytest.mark.slow
def test_the_console_says_where_workers_run_and_a_url_run_drops_its_working_copy(
    tmp_path, tiny_model_dir, arithmetic_jsonl, capsys, monkeypatch
):
    monkeypatch.setenv("POSTRL_RUN_CACHE", str(tmp_path / "cache"))
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, steps=1)
    url = f"file://{tmp_path / 'bucket'}"
    assert main(["train", config, f"output_dir={url}"]) == 0
    err = capsys.readouterr().err
    assert (
        "workers: train 1 rank in this process, device auto; rollout 1 auto engine in this process, device auto; "
        "reward 1 scoring process"
    ) in err
    copies = list((tmp_path / "cache").iterdir())
    assert f"run: {url}/tiny (working copy on this machine: " in err and "removed the working copy" in err
    assert copies == [] and (tmp_path / "bucket" / "tiny" / "final_model" / "config.json").is_file()
    assert main(["train", config, f"output_dir={url}", "name=kept", "keep_local_copy=true"]) == 0
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_an_update_a_bf16_engine_cannot_see_is_warned_once():
    from postrl.config.loading import build_config
    from postrl.run.watch import UpdateVisibilityWatch
    from postrl.types import StepMetrics

    config = build_config({}, ["rollout.dtype=bfloat16", "train.lr=5e-6"])
    said: list[str] = []
    watch = UpdateVisibilityWatch(config, said.append)
    watch.observe(StepMetrics(1, 1, {"train/update_visible_bf16": 0.8}))
    assert said == []
    watch.observe(StepMetrics(2, 2, {"train/update_visible_bf16": 0.14}))
    watch.observe(StepMetrics(3, 3, {"train/update_visible_bf16": 0.1}))
    assert said == [
        "warning: at step 2 only 14% of the update (train/update_visible_bf16) changed the bf16 rounding of the "
        "weights at train.lr=5e-06: the auto engine in bfloat16 samples with that rounding, so it keeps sampling "
        "from older weights until the changes add up. Set rollout.dtype=float32, or raise train.lr"
    ]
    # a float32 engine samples with the master weights themselves: nothing to say
    said.clear()
    fp32 = UpdateVisibilityWatch(build_config({}, ["rollout.dtype=float32"]), said.append)
    fp32.observe(StepMetrics(2, 2, {"train/update_visible_bf16": 0.1}))
    assert said == []


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_an_auto_engine_is_warned_about_only_where_it_runs_in_bf16(monkeypatch, fast_bf16):
    from postrl.config.loading import build_config
    from postrl.models import numerics
    from postrl.run.watch import UpdateVisibilityWatch
    from postrl.types import StepMetrics

    monkeypatch.setattr(numerics, "bf16_is_fast", lambda device: fast_bf16)
    said: list[str] = []
    watch = UpdateVisibilityWatch(build_config({}, ["rollout.dtype=auto", "rollout.device=cpu"]), said.append)
    watch.observe(StepMetrics(2, 2, {"train/update_visible_bf16": 0.1}))
    assert len(said) == (1 if fast_bf16 else 0)


def test_the_visible_share_of_an_update_by_hand():
    """At 1.0 a bf16 step is 2^-7: a change of 0.01 moves the bf16 value, one of 0.001 does not, so
    0.01 of the 0.01 + 3 x 0.001 changed is visible; bf16 parameters are not measured."""
    from postrl.train.update_visibility import Bf16Visibility

    model = torch.nn.Linear(2, 2, bias=True)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    meter = Bf16Visibility(model)
    meter.start()
    with torch.no_grad():
        model.weight += torch.tensor([[0.01, 0.001], [0.001, 0.0]])
        model.bias += torch.tensor([0.001, 0.0])
    assert meter.share() == pytest.approx(0.01 / 0.013, rel=1e-4)  # float32 holds 1.01 to 6e-8
    assert meter.share() is None  # one measurement per start()
    assert not Bf16Visibility(torch.nn.Linear(2, 2).to(torch.bfloat16)).applies
