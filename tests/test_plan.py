"""The capacity planner: hand-computed figures, the design's 70B example, measured peaks, the
pre-launch check and the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from postrl.cli import main
from postrl.config.run import ConfigError, RunConfig
from postrl.run.plan.check import target_for
from postrl.run.plan.design_example import LLAMA_70B, design_example
from postrl.run.plan.gpus import gpu_spec
from postrl.run.plan.measure import TensorBytes, measure_case
from postrl.run.plan.memory import (
    MicroBatch,
    RolloutSetup,
    TrainSetup,
    layer_activation_bytes,
    lora_params,
    rollout_memory,
    train_rank_memory,
)
from postrl.run.plan.planner import Target, make_plan
from postrl.run.plan.shape import ModelShape, ShapeError, load_shape, shape_from_config

MHA_UNTIED = ModelShape(
    vocab=1000, hidden=64, layers=2, heads=4, kv_heads=4, head_dim=16, intermediate=128, tied_embeddings=False
)
SMOLLM2 = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


def test_parameters_and_kv_of_an_untied_mha_model_by_hand():
    s = MHA_UNTIED
    # embedding 1000*64 + head 1000*64 + norms 5*64 + 2 layers * (q,k,v,o 4*64*64 + mlp 3*64*128)
    assert s.params == 64000 + 64000 + 320 + 2 * (16384 + 24576) == 210240
    assert s.kv_bytes_per_token(4) == 2 * 2 * 4 * 16 * 4 == 1024
    memory = train_rank_memory(s, TrainSetup(4, 4, False, MicroBatch(1, 2, 4, 3), False))
    assert memory.items["weights"] == 4 * 210240
    assert memory.items["gradients"] == 4 * 210240
    assert memory.items["optimizer"] == 8 * 210240
    assert memory.detail["model_state_bytes_per_param"] == 16


def test_gqa_tied_model_by_hand_and_tensor_parallel_kv():
    s = shape_from_config(SMOLLM2)
    # tied: no head; per layer q 576*576, k and v 576*192 each, o 576*576, mlp 3*576*1536, two norms
    per_layer = 331776 + 2 * 110592 + 331776 + 2654208 + 2 * 576
    assert s.params == 49152 * 576 + 30 * per_layer + 576 == 134515008
    assert s.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2 == 23040
    assert s.kv_bytes_per_token(2, tensor_parallel=4) == 2 * 30 * 1 * 64 * 2  # 3 heads on 4 ranks: one each
    setup = RolloutSetup(2, concurrency=10, max_len=100, prefill_tokens=64, prompt_tokens=32)
    engine = rollout_memory(s, setup, tp=1)
    assert engine.items["weights"] == 2 * 134515008
    assert engine.items["kv_cache"] == 10 * 100 * 23040


def test_activations_of_one_layer_by_hand():
    # one group: a 4-token prompt and 2 responses of 3: 10 tokens, 3 blocks of 4 queries over 7 keys
    micro = MicroBatch(groups=1, rows=2, prompt_tokens=4, response_tokens=3)
    assert (micro.tokens, micro.blocks) == (10, 3)
    # per token: norm inputs and outputs 4*64, attention output 64, gate/up/product 3*128 = 704
    # per block: gathered q (4) and k, v (7 each) of 4x16, probabilities 4 heads x 4 x 7 = 1264
    assert layer_activation_bytes(MHA_UNTIED, micro, 4) == 4 * (10 * 704 + 3 * 1264) + 2 * 10 * 4 == 43408


def test_lora_trains_adapters_only():
    s = MHA_UNTIED
    assert lora_params(s, 8, ("q_proj", "down_proj")) == 2 * (8 * (64 + 64) + 8 * (128 + 64))
    full = train_rank_memory(s, TrainSetup(4, 4, False, MicroBatch(1, 2, 4, 3), False))
    lora = train_rank_memory(s, TrainSetup(4, 4, False, MicroBatch(1, 2, 4, 3), False, 8, ("q_proj", "down_proj")))
    assert lora.items["gradients"] == 4 * 5120 < full.items["gradients"]
    assert lora.items["optimizer"] == 8 * 5120


def write_model_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def seventy_b_config(folder: Path, **overrides) -> RunConfig:
    """The design's example: a 70B model generating 64 sequences of 8k tokens in bf16."""
    return RunConfig.model_validate(
        {
            "model": {"path": str(write_model_config(folder, LLAMA_70B)), "dtype": "bfloat16"},
            "prompts_per_step": 8,
            "data": {"task": "arithmetic", "max_prompt_tokens": 7168},
            "rollout": {"n": 8, "max_tokens": 1024, "max_batch_size": 64},
            **overrides,
        }
    )


def test_the_designs_70b_example_at_tp8(tmp_path):
    example = design_example()
    assert example["weights_gb"] == pytest.approx(70_553_706_496 * 2 / 8 / 1e9, abs=1e-3)  # 17.64: 70.55B x 2 / 8
    assert example["kv_gb"] == pytest.approx(8192 * 64 * 2 * 80 * 1 * 128 * 2 / 1e9, abs=1e-3)  # 21.47
    assert example["ok"] and not design_example(tolerance=0.01)["ok"]  # 17.64 is 0.8% over the design's 17.5
    # model states: the design's 12 bytes per parameter leave out the fp32 master weights
    assert example["model_state_bytes_per_param"] == 16
    plan = make_plan(seventy_b_config(tmp_path / "m"), Target(gpu_spec("H100")))
    assert plan.rollout_tp == 8  # at TP=4: 35.3 GB of weights + 42.9 GB of KV > 73.6 GB usable
    assert plan.role("rollout engine").items["kv_cache"] / 1e9 == pytest.approx(21.47, rel=0.01)


def test_a_run_that_does_not_fit_names_the_role_and_the_fix(tmp_path):
    config = seventy_b_config(tmp_path / "m", model={"path": str(tmp_path / "m"), "dtype": "float32"})
    plan = make_plan(config, Target(gpu_spec("H100")), gpus=8)
    assert not plan.fits
    problem = next(p for p in plan.problems if p.role == "train rank")
    assert any("model.lora.r=16" in fix for fix in problem.fixes)
    assert "train rank needs" in problem.message()
    # the fix, applied, fits: the train rank of the changed run needs at most the usable memory
    (fix,) = problem.fixes
    assert fix.startswith("together: ")
    budget = int(fix.rsplit("train.micro_batch_tokens=", 1)[1])
    fixed = seventy_b_config(
        tmp_path / "m",
        model={"path": str(tmp_path / "m"), "dtype": "float32", "gradient_checkpointing": True, "lora": {"r": 16}},
        train={"forward": "transformers", "micro_batch_tokens": budget},
    )
    replanned = make_plan(fixed, Target(gpu_spec("H100")), gpus=8)
    assert (
        replanned.train_fsdp is not None and replanned.role("train rank").total <= Target(gpu_spec("H100")).usable_bytes
    )
    assert "train rank" not in {p.role for p in replanned.problems}


@pytest.mark.parametrize(
    "name,model,extra",
    [
        ("demo fp32", "demo", {}),
        ("tiny GQA llama bf16 autocast", "tiny", {"train": {"precision": "bf16_autocast", "fused_head": False}}),
        ("tiny GQA llama checkpointing", "tiny", {"model": {"gradient_checkpointing": True}}),
        (
            "SmolLM2-135M shape",
            "smollm2",
            {"prompts_per_step": 2, "train": {"micro_batch_size": 8, "mini_batch_size": 16}},
        ),
    ],
)
@pytest.mark.slow
def test_planned_peaks_are_within_15_percent_of_measured(name, model, extra, tmp_path, char_tokenizer):
    """Measured: peak bytes of live tensors (TensorBytes) in the trainer's second update of a
    full-length step and in the engine's generation; planned: the same config on this CPU."""
    path = "demo" if model == "demo" else str(random_model(tmp_path / model, model, char_tokenizer))
    base = {
        "model": {"path": path},
        "prompts_per_step": 4,
        "data": {"task": "arithmetic", "max_prompt_tokens": 40},
        "rollout": {"n": 8, "max_tokens": 16, "device": "cpu"},
        "train": {"mini_batch_size": 32, "micro_batch_size": 16, "device": "cpu"},
    }
    for key, value in extra.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    case = measure_case(name, RunConfig.model_validate(base))
    assert abs(case.errors["train"]) <= 0.15, case.to_dict()
    assert abs(case.errors["rollout"]) <= 0.15, case.to_dict()


def random_model(folder: Path, kind: str, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "tiny":
        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=96,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    else:
        cfg = LlamaConfig(**{k: v for k, v in SMOLLM2.items() if k != "model_type"})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def test_tensor_bytes_counts_each_storage_once_while_alive():
    with TensorBytes() as counter:
        a = torch.ones(1000)  # 4000 bytes
        view = a[:10]  # a view: no new storage
        b = a * 2  # 4000 more
        assert counter.live == 8000
        del b
        assert counter.live == 4000
        c = torch.ones(250)
    assert counter.peak == 8000 and counter.live == 5000
    assert view.sum() + c.sum() > 0


QWEN2_1_5B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}


def test_train_refuses_a_run_that_does_not_fit_before_loading(tmp_path, capsys, monkeypatch):
    """A 1.5B model in float32 (16 bytes of model state per parameter: 24.7 GB) on a machine with
    16 GB available: refused before any weights are looked for (the folder has none)."""
    from postrl.run.plan import check
    from postrl.run.train_runner import train

    monkeypatch.setattr(check, "available_ram_bytes", lambda: 16 * 10**9)
    model = write_model_config(tmp_path / "m", QWEN2_1_5B)
    run = {
        "model": {"path": str(model)},
        "output_dir": str(tmp_path / "runs"),
        "data": {"task": "arithmetic", "max_prompt_tokens": 64},
    }
    with pytest.raises(ConfigError, match=r"train rank needs \d\d\.\d\d GB on the CPU.*model\.lora\.r=16"):
        train(RunConfig.model_validate(run))
    assert not (tmp_path / "runs").exists()  # nothing written
    warned = RunConfig.model_validate({**run, "plan": {"check": "warn"}})
    with pytest.raises(Exception) as failure:  # goes on, and fails where the weights should be
        train(warned)
    assert not isinstance(failure.value, ConfigError) or "does not fit" not in str(failure.value)
    assert "warning: the run may not fit" in capsys.readouterr().err


def test_the_check_steps_aside_for_a_model_it_cannot_read(tmp_path):
    from postrl.run.plan.check import check_plan

    folder = write_model_config(tmp_path / "m", {"model_type": "mystery", "hidden_size": 8})
    said: list[str] = []
    config = RunConfig.model_validate({"model": {"path": str(folder)}})
    assert check_plan(config, said.append) is None
    assert said == [
        f"note: the memory check was skipped ({folder / 'config.json'}: no num_attention_heads or n_head (the planner needs it))"
    ]


def test_plan_command_prints_a_table_and_json(capsys, tmp_path):
    assert main(["plan", "examples/arithmetic_grpo.yaml", "--gpu", "A100", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "rollout engine" in out and "train rank" in out and "split of 4 GPUs" in out
    assert main(["plan", "examples/arithmetic_grpo.yaml", "--gpu", "rtx 4090", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["gpu"]["name"] == "RTX4090" and plan["fits"] is True
    assert plan["roles"][1]["items_gb"]["optimizer"] == pytest.approx(8 * 1791360 / 1e9, abs=1e-4)
    folder = write_model_config(tmp_path / "m", LLAMA_70B)
    assert main(["plan", "examples/arithmetic_grpo.yaml", f"model.path={folder}", "--gpus", "8"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bad_inputs_name_the_file_and_field(tmp_path):
    with pytest.raises(ShapeError, match="no config.json"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 8,')
    with pytest.raises(ShapeError, match="invalid JSON at line 1"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "num_attention_heads": 2}')
    with pytest.raises(ShapeError, match="no vocab_size"):
        load_shape(str(tmp_path))
    with pytest.raises(ValueError, match="unknown GPU 'B300'"):
        target_for("B300", None)
