"""CUDA paths (marked ``gpu``; skipped with the reason on a machine without CUDA, run by
scripts/gpu_check.sh on a GPU machine): the native engine, the Train Worker in bf16, a short run."""

from __future__ import annotations

import json

import pytest
import torch

from postrl.config.loading import build_config
from postrl.config.run import AlgorithmConfig, RolloutConfig, TrainConfig
from postrl.models.devices import DeviceError, resolve_device
from postrl.models.loading import load_causal_lm
from postrl.rollout.factory import rollout_worker_for_model
from postrl.train.worker import PolicyTrainer
from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams
from tests.conftest import hf_greedy, make_tiny_model

pytestmark = pytest.mark.serial  # one GPU: its tests one after another on one worker


def test_a_missing_cuda_device_is_an_error_naming_the_field():
    wanted = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(DeviceError, match=f"train.device={wanted}"):
        resolve_device(wanted, "train.device")
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
def test_native_engine_on_cuda_matches_the_hf_model_greedily(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer).to("cuda")
    engine = rollout_worker_for_model(
        RolloutConfig(backend="native", dtype="float32"), model, char_tokenizer, "float32", seed=0
    )
    assert engine.model.device.type == "cuda"
    ids = char_tokenizer("12+34=")["input_ids"]
    out = engine.generate([Prompt("12+34=", ids)], SamplingParams(n=1, top_k=1, max_tokens=12), 0)[0]
    assert (out.response_ids, out.finish_reason) == hf_greedy(model, char_tokenizer, "12+34=", 12)


@pytest.mark.gpu
def test_train_worker_on_cuda_uses_bf16_autocast_with_fp32_master_weights(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer).to("cuda")
    worker = PolicyTrainer(
        model, TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2, device="cuda"), AlgorithmConfig()
    )
    exps = [Experience([1, 20, 21], [30, 31, 2], [-1.0, -1.2, -0.5], 1.0, a, 0, group_id=0) for a in (1, -1, 1, -1)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = worker.update(ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id))
    assert metrics.optimizer_steps == 1 and torch.isfinite(torch.tensor(metrics.get("actor/loss")))
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in model.parameters())
    state = worker.optimization.optimizer.state[next(model.parameters())]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].device.type == "cuda"
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    with worker._autocast():
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16 and torch.is_autocast_enabled("cuda")


@pytest.mark.gpu
def test_two_step_run_on_cuda(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from postrl.run.train_runner import train

    config = build_config(
        {
            "name": "cuda",
            "output_dir": str(tmp_path),
            "steps": 2,
            "prompts_per_step": 4,
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_files": [str(arithmetic_jsonl)]},
            "rollout": {"n": 4, "max_tokens": 8, "device": "cuda"},
            "train": {"device": "cuda", "mini_batch_size": 16},
            "reward": {
                "components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]
            },
            "logging": {"trackers": ["jsonl"]},
        }
    )
    controller = train(config).controller
    assert controller.step_count == 2
    assert next(controller.parts.trainer.handle.obj.model.parameters()).device.type == "cuda"
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
    load_causal_lm(str(config.run_dir / "final_model"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_on_cuda_gives_the_trainer_s_logprobs_bit_for_bit(char_tokenizer, dtype):
    """rollout.exact on CUDA: the engine's logprobs of a sampled group equal the trainer's exact
    recomputation, with the GPU's fixed batches (postrl.models.invariant.fixed_batches)."""
    from postrl.rollout.native.engine import NativeRolloutWorker
    from postrl.train.exact_forward import ExactForward, exact_layout

    model = make_tiny_model("llama", char_tokenizer).to("cuda")
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, dtype, exact=True)
    prompts = [Prompt(t, char_tokenizer(t)["input_ids"]) for t in ("12+7=", "what is 3*4?")]
    rollouts = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=70), None)
    ids = [list(r.prompt_ids) + list(r.response_ids) for r in rollouts]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids], device="cuda")
    spans = [(len(r.prompt_ids), len(r.response_ids)) for r in rollouts]
    groups = torch.tensor([r.prompt_index for r in rollouts], device="cuda")
    targets = torch.tensor([t for r in rollouts for t in r.response_ids], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), torch.no_grad():
        logp, _ = ExactForward(model).token_logprobs(exact_layout(input_ids, spans, groups), targets, 1.0, False)
    reported = torch.tensor([lp for r in rollouts for lp in r.logprobs], device="cuda")
    assert torch.equal(logp, reported)
