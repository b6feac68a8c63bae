"""The built-in engine against transformers, and against the Train Worker's logprobs."""

from __future__ import annotations

import pytest
import torch

from postrl.rollout import HFRolloutWorker
from postrl.train.logprobs import token_logprobs
from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams
from tests.conftest import hf_greedy, make_tiny_model, seqs


def prompts_for(tokenizer, texts):
    return [Prompt(text=t, prompt_ids=tokenizer(t)["input_ids"]) for t in texts]


TEXTS = ["12+34=", "7+5=", "123+456=", "hello"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_matches_transformers_generate(char_tokenizer, kind):
    model = make_tiny_model(kind, char_tokenizer)
    engine = HFRolloutWorker(model, char_tokenizer)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=12)
    rollouts = engine.generate(prompts_for(char_tokenizer, TEXTS), params, 0)
    for text, r in zip(TEXTS, rollouts):
        assert (r.response_ids, r.finish_reason) == hf_greedy(model, char_tokenizer, text, 12)


def test_sampled_logprobs_match_trainer_recompute(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    engine = HFRolloutWorker(model, char_tokenizer, seed=5)
    rollouts = engine.generate(
        prompts_for(char_tokenizer, TEXTS), SamplingParams(n=3, temperature=0.8, max_tokens=10), 0
    )
    assert len(rollouts) == 12 and [r.prompt_index for r in rollouts] == [i for i in range(4) for _ in range(3)]
    exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 0) for r in rollouts]
    batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.8)
    diff = ((logp - batch.old_logprobs) * batch.response_mask).abs().max().item()
    assert diff < 1e-4


def test_seeded_sampling_is_reproducible_and_batching_invariant(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    together = HFRolloutWorker(model, char_tokenizer).generate(prompts_for(char_tokenizer, TEXTS), params, 0)
    one_by_one = HFRolloutWorker(model, char_tokenizer, max_batch_size=1).generate(
        prompts_for(char_tokenizer, TEXTS), params, 0
    )
    assert seqs(together) == seqs(one_by_one)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11)
    a = HFRolloutWorker(model, char_tokenizer).generate(prompts_for(char_tokenizer, TEXTS), sp, 0)
    b = HFRolloutWorker(model, char_tokenizer).generate(prompts_for(char_tokenizer, TEXTS), sp, 0)
    assert seqs(a) == seqs(b)


def test_top_k_one_is_greedy(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    engine = HFRolloutWorker(model, char_tokenizer)
    greedy = engine.generate(prompts_for(char_tokenizer, TEXTS), SamplingParams(temperature=0.0, max_tokens=6), 0)
    topk = engine.generate(
        prompts_for(char_tokenizer, TEXTS), SamplingParams(temperature=1.5, top_k=1, max_tokens=6), 0
    )
    tiny_p = engine.generate(
        prompts_for(char_tokenizer, TEXTS), SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=6), 0
    )
    assert seqs(greedy) == seqs(topk) == seqs(tiny_p)


def test_stop_strings_stop_tokens_and_max_tokens(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    engine = HFRolloutWorker(model, char_tokenizer)
    prompts = prompts_for(char_tokenizer, TEXTS)
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), 0)
    target = free[0].text[3:5]  # two characters the model will produce
    stopped = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=20, stop=(target,)), 0)[0]
    assert stopped.finish_reason == "stop" and stopped.text.endswith(target) and stopped.text.count(target) == 1
    assert len(stopped.response_ids) == len(stopped.logprobs) <= 5
    stop_id = free[0].response_ids[2]
    by_id = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_id,)), 0)[
        0
    ]
    assert by_id.response_ids[-1] == stop_id and by_id.finish_reason == "stop"
    short = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=3), 0)
    assert all(len(r.response_ids) <= 3 for r in short)
    assert all(
        r.finish_reason == "length"
        for r in short
        if len(r.response_ids) == 3 and r.response_ids[-1] != char_tokenizer.eos_token_id
    )


def test_weight_update_changes_outputs_and_version(char_tokenizer, tmp_path):
    from safetensors.torch import save_file

    model = make_tiny_model("llama", char_tokenizer)
    other = make_tiny_model("llama", char_tokenizer, seed=42)
    engine = HFRolloutWorker(model, char_tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    before = [r.logprobs for r in engine.generate(prompts_for(char_tokenizer, TEXTS), params, 0)]
    engine.update_weights(other.state_dict(), version=1)
    after = engine.generate(prompts_for(char_tokenizer, TEXTS), params, 1)
    assert [r.logprobs for r in after] != before and all(r.weight_version == 1 for r in after)
    path = tmp_path / "w.safetensors"
    state = {k: v for k, v in make_tiny_model("llama", char_tokenizer).state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(path))
    engine.update_weights(path, version=2)
    assert [r.logprobs for r in engine.generate(prompts_for(char_tokenizer, TEXTS), params, 2)] == before
    with pytest.raises(RuntimeError, match="weight_version 1, engine holds 2"):
        engine.generate(prompts_for(char_tokenizer, TEXTS), params, 1)
    with pytest.raises(RuntimeError, match="do not fit the model"):
        engine.update_weights({"model.embed_tokens.weight": torch.zeros(3, 3)}, version=3)
    assert engine.health_check()


def test_bfloat16_engine_takes_fp32_weights_and_stays_close(char_tokenizer):
    fp32 = make_tiny_model("llama", char_tokenizer)
    engine = HFRolloutWorker(
        make_tiny_model("llama", char_tokenizer, seed=9).to(torch.bfloat16), char_tokenizer, seed=1
    )
    engine.update_weights(fp32.state_dict(), version=1)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    rollouts = engine.generate(prompts_for(char_tokenizer, TEXTS), SamplingParams(n=2, max_tokens=6), 1)
    exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 1) for r in rollouts]
    batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(fp32, batch.input_ids, batch.attention_mask)
    assert ((logp - batch.old_logprobs) * batch.response_mask).abs().max().item() < 0.1


def test_generation_builds_no_autograd_graph(char_tokenizer):
    """Rollouts never need gradients: a graph would cost memory and time (it once did, silently)."""
    model = make_tiny_model("llama", char_tokenizer)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.requires_grad))
    HFRolloutWorker(model, char_tokenizer).generate(
        prompts_for(char_tokenizer, TEXTS[:2]), SamplingParams(n=2, temperature=1.0, max_tokens=4), 0
    )
    assert seen and not any(seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hf_engine_samples_on_the_models_device(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer).cuda()
    out = HFRolloutWorker(model, char_tokenizer, seed=3).generate(
        prompts_for(char_tokenizer, TEXTS[:2]), SamplingParams(n=2, temperature=1.0, max_tokens=4), 0
    )
    assert len(out) == 4 and all(1 <= len(r.response_ids) <= 4 for r in out)
