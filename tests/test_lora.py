"""LoRA: only adapters train, the reference is the base model, the native engine applies synced
adapters unmerged and equals the trainer, resume is bit-exact, both exports load."""

from __future__ import annotations

import copy

import pytest
import torch

from postrl.config.run import AlgorithmConfig, LoraConfig, TrainConfig
from postrl.models.weights import weight_manifest
from postrl.rollout.native import NativeRolloutWorker
from postrl.train.logprobs import token_logprobs
from postrl.train.lora import adapter_state, apply_lora, merged_state
from postrl.train.worker import PolicyTrainer
from postrl.types import Experience, ExperienceBatch, SamplingParams
from tests.conftest import make_tiny_model
from tests.test_microbatch import grouped_batch
from tests.test_native_engine import prompts_for

LORA = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
TRAIN = TrainConfig(lr=5e-2, mini_batch_size=12, micro_batch_size=4, precision="float32")


def lora_worker(base, lora=LORA, kl_beta=0.1, seed=0) -> PolicyTrainer:
    policy = apply_lora(copy.deepcopy(base), lora)
    return PolicyTrainer(policy, TRAIN, AlgorithmConfig(kl_beta=kl_beta), lora=lora, seed=seed)


def sampled_and_rescored(engine, policy, base, tokenizer):
    """The engine's samples (temperature 0.7) as a batch holding its logprobs, and the same tokens'
    logprobs under the trainer's ``policy`` and under ``base``."""
    rollouts = engine.generate(prompts_for(tokenizer), SamplingParams(n=4, temperature=0.7, max_tokens=12), 1)
    exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 0) for r in rollouts]
    batch = ExperienceBatch.from_experiences(exps, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logprobs(policy, batch.input_ids, batch.attention_mask, 0.7, target_mask=batch.response_mask)
        plain, _ = token_logprobs(base, batch.input_ids, batch.attention_mask, 0.7, target_mask=batch.response_mask)
    return batch, trainer, plain


def test_only_adapters_change_and_the_reference_is_the_base_model(char_tokenizer):
    base = make_tiny_model("llama", char_tokenizer)
    batch = grouped_batch(char_tokenizer)
    worker = lora_worker(base)
    with torch.no_grad():
        want_ref, _ = token_logprobs(base, batch.input_ids, batch.attention_mask, target_mask=batch.response_mask)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    for _ in range(2):
        worker.update(batch)
    after = dict(worker.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B starts at 0: the adapters now do something
    assert sum(p.numel() for p in worker.optimization.optimizer.param_groups[0]["params"]) < 0.2 * sum(
        p.numel() for p in base.parameters()
    )
    ref = worker.reference_logprobs(batch)
    assert float((ref - want_ref).abs().max()) < 1e-6  # adapters off = the base model, no second copy
    with torch.no_grad():
        policy, _ = token_logprobs(worker.model, batch.input_ids, batch.attention_mask, target_mask=batch.response_mask)
    assert float((policy - want_ref).abs().max()) > 1e-3  # and the policy has moved away from it


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_engine_with_unmerged_adapters_equals_the_trainer(char_tokenizer, kind):
    base = make_tiny_model(kind, char_tokenizer)
    worker = lora_worker(base, kl_beta=0.0)
    for _ in range(2):
        worker.update(grouped_batch(char_tokenizer))
    engine = NativeRolloutWorker.from_hf(base, char_tokenizer, seed=3)  # the base weights only
    state = adapter_state(worker.model)
    assert all(k.endswith((".lora_A", ".lora_B", ".lora_scale")) for k in state)
    engine.update_weights(state, 1, manifest=weight_manifest(state))
    batch, trainer, plain = sampled_and_rescored(engine, worker.model, base, char_tokenizer)
    gap = float(((trainer - batch.old_logprobs) * batch.response_mask).abs().max())
    assert gap <= 1e-5
    assert float(((plain - batch.old_logprobs) * batch.response_mask).abs().max()) > 1e-3  # the adapters took effect
    merged = merged_state(worker.model)  # the merged sync path computes the same function in float32
    engine.update_weights(merged, 2)
    again = engine.generate(prompts_for(char_tokenizer), SamplingParams(temperature=0.0, max_tokens=12), 2)
    engine.update_weights(state, 3)
    unmerged = engine.generate(prompts_for(char_tokenizer), SamplingParams(temperature=0.0, max_tokens=12), 3)
    assert [r.response_ids for r in again] == [r.response_ids for r in unmerged]


def test_bad_adapters_are_refused_before_anything_changes(char_tokenizer):
    base = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(base, char_tokenizer)
    state = adapter_state(lora_worker(base).model)
    wrong = dict(state)
    key = next(k for k in state if k.endswith("q_proj.lora_A"))
    wrong[key] = torch.zeros(4, 7)
    with pytest.raises(RuntimeError, match="do not fit"):
        engine.update_weights(wrong, 1)
    incomplete = {k: v for k, v in state.items() if not k.endswith("v_proj.lora_scale")}
    with pytest.raises(RuntimeError, match="needs lora_A, lora_B and lora_scale"):
        engine.update_weights(incomplete, 1)
    assert not engine.model.adapters


def test_checkpoint_resume_is_bit_exact(char_tokenizer, tmp_path):
    base = make_tiny_model("llama", char_tokenizer)
    batch = grouped_batch(char_tokenizer)
    first = lora_worker(base)
    first.update(batch)
    first.save_checkpoint(tmp_path / "ckpt")
    first.update(batch)
    resumed = lora_worker(base)
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.update(batch)
    a, b = dict(first.model.named_parameters()), dict(resumed.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], p) for n, p in lora_worker(base).model.named_parameters())


@pytest.mark.parametrize("export", ["merged", "adapter"])
@pytest.mark.slow
def test_exports_load_in_transformers_and_peft(char_tokenizer, tmp_path, export):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = make_tiny_model("llama", char_tokenizer)
    lora = LORA.model_copy(update={"export": export})
    worker = lora_worker(base, lora=lora)
    worker.update(grouped_batch(char_tokenizer))
    worker.save_pretrained(tmp_path / "final")
    ids = torch.tensor([char_tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        want = worker.model(input_ids=ids).logits
        if export == "merged":
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
        else:
            loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "final")
        got = loaded(input_ids=ids).logits
    assert float((got - want).abs().max()) < 1e-5


@pytest.mark.slow
def test_train_and_dpo_runs_with_lora_end_to_end(tmp_path, tiny_model_dir, arithmetic_jsonl):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from postrl.cli import main
    from tests.test_golden_paths import LENGTH_REWARD
    from tests.test_train_e2e import write_config

    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        model={"path": str(tiny_model_dir), "lora": {"r": 4, "alpha": 8, "export": "adapter"}},
        reward=LENGTH_REWARD,
        algorithm={"kl_beta": 0.05},
        train={"lr": 3e-2, "mini_batch_size": 8, "micro_batch_size": 4},
    )
    assert main(["train", config]) == 0
    run = tmp_path / "runs" / "tiny"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["actor/kl"] > 0  # the adapters moved the policy off the base model
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4  # the engine applies the synced adapters
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run / "final_model")

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": "7"}) + "\n" for a in range(10, 26)
        )
    )
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text(
        f"name: d\noutput_dir: {tmp_path}/runs\nmodel: {{path: {tiny_model_dir}, lora: {{r: 4}}}}\n"
        f"data: {{train_files: [{pairs}]}}\ntrain: {{lr: 1.0e-2, mini_batch_size: 8, micro_batch_size: 4}}\n"
        "checkpoint: {every_steps: 0}\nlogging: {trackers: [jsonl]}\n"
    )
    assert main(["dpo", str(dpo)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "d" / "final_model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = [n for n, p in merged.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert moved and all(n.endswith("_proj.weight") for n in moved)  # merged adapters; embeddings, norms as they were


def test_lora_configs_that_cannot_work_are_refused(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from postrl.config.loading import build_config
    from postrl.config.run import ConfigError

    base = {"model": {"path": str(tiny_model_dir), "lora": {"r": 4}}, "data": {"train_files": [str(arithmetic_jsonl)]}}
    with pytest.raises((ConfigError, ValueError), match="model.lora.sync=adapter"):
        build_config({**base, "rollout": {"backend": "hf"}})  # the transformers engine takes whole weights
    build_config({**base, "rollout": {"backend": "vllm"}})  # vLLM applies adapters with its LoRA layers
    assert build_config(base).model.synced_adapter_rank == 4
    merged = build_config({**base, "model": {**base["model"], "lora": {"r": 4, "sync": "merged"}}})
    assert merged.model.synced_adapter_rank is None  # whole weights: no engine needs LoRA layers


def test_bf16_engine_applies_adapters_as_the_trainer_does(char_tokenizer):
    """In bf16 on a CPU that prepacks weights, each layer's stacked A rides in its fused
    projection's packed weight ([W; A]); elsewhere they are separate products. Either way the
    engine's logprobs follow the trainer's (float32) to bf16 rounding, far closer than the base
    model's."""
    base = make_tiny_model("llama", char_tokenizer)
    worker = lora_worker(base, kl_beta=0.0)
    for _ in range(2):
        worker.update(grouped_batch(char_tokenizer))
    engine = NativeRolloutWorker.from_hf(base, char_tokenizer, dtype=torch.bfloat16, seed=3)
    engine.update_weights(adapter_state(worker.model), 1)
    batch, trainer, plain = sampled_and_rescored(engine, worker.model, base, char_tokenizer)
    mask = batch.response_mask
    gap = float(((trainer - batch.old_logprobs) * mask).abs().sum() / mask.sum())
    off = float(((plain - batch.old_logprobs) * mask).abs().sum() / mask.sum())
    assert gap < 2e-3 and off > 0.05  # measured: 7e-4 and 0.18 (mean per response token)
