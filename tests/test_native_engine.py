"""The native engine against transformers and the Train Worker; continuous batching; verified sync."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from postrl.models.weights import WeightSyncError, weight_manifest
from postrl.rollout import HFRolloutWorker
from postrl.rollout.native import NativeRolloutWorker
from postrl.train.logprobs import token_logprobs
from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams
from tests.conftest import hf_greedy, make_tiny_model, seqs

TEXTS = ["12+34=", "7+5=", "123+456=", "hello", "a much longer prompt than the others"]


def prompts_for(tokenizer, texts=TEXTS):
    return [Prompt(text=t, prompt_ids=tokenizer(t)["input_ids"]) for t in texts]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_equals_transformers_token_for_token(char_tokenizer, kind):
    model = make_tiny_model(kind, char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer)
    for text, r in zip(
        TEXTS, engine.generate(prompts_for(char_tokenizer), SamplingParams(temperature=0.0, max_tokens=16), 0)
    ):
        assert (r.response_ids, r.finish_reason) == hf_greedy(model, char_tokenizer, text, 16)


@pytest.mark.slow
def test_continuous_batching_equals_one_at_a_time(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=10, stop=("9",))
    wide = NativeRolloutWorker.from_hf(model, char_tokenizer, max_batch_size=64).generate(
        prompts_for(char_tokenizer), params, 0
    )
    narrow = NativeRolloutWorker.from_hf(model, char_tokenizer, max_batch_size=2).generate(
        prompts_for(char_tokenizer), params, 0
    )
    single = NativeRolloutWorker.from_hf(model, char_tokenizer, max_batch_size=1).generate(
        prompts_for(char_tokenizer), params, 0
    )
    assert seqs(wide) == seqs(narrow) == seqs(single)
    assert [(r.prompt_index) for r in wide] == [i for i in range(len(TEXTS)) for _ in range(3)]
    hf = HFRolloutWorker(model, char_tokenizer).generate(prompts_for(char_tokenizer), params, 0)
    assert seqs(wide) == seqs(hf)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.slow
def test_sampled_logprobs_match_trainer_within_1e4(char_tokenizer, kind):
    model = make_tiny_model(kind, char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, max_batch_size=4, seed=3)
    rollouts = engine.generate(prompts_for(char_tokenizer), SamplingParams(n=4, temperature=0.7, max_tokens=12), 0)
    exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 0) for r in rollouts]
    batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7)
    assert ((logp - batch.old_logprobs) * batch.response_mask).abs().max().item() <= 1e-4


def test_prefix_sharing_samples_differ_but_start_from_one_prefill(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, seed=0)
    rollouts = engine.generate(
        prompts_for(char_tokenizer, ["12+34="]), SamplingParams(n=8, temperature=1.5, max_tokens=8), 0
    )
    assert len({tuple(r.response_ids) for r in rollouts}) > 1
    # every sample's first token is drawn from the one prefill's distribution: its logprob is that
    # distribution's, whichever token it drew
    ids = char_tokenizer("12+34=")["input_ids"]
    with torch.no_grad():
        dist = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float() / 1.5, -1)
    for r in rollouts:
        assert abs(dist[r.response_ids[0]].item() - r.logprobs[0]) < 1e-5


def test_weight_sync_in_place_changes_outputs_and_corruption_is_caught(char_tokenizer, tmp_path):
    from safetensors.torch import save_file

    model = make_tiny_model("qwen2", char_tokenizer)
    other = make_tiny_model("qwen2", char_tokenizer, seed=7)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer)
    buffers = [t.data_ptr() for t in engine.model.wqkv]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    before = [r.logprobs for r in engine.generate(prompts_for(char_tokenizer), params, 0)]
    state = dict(other.state_dict())
    engine.update_weights(state, 1, manifest=weight_manifest(state))
    assert [t.data_ptr() for t in engine.model.wqkv] == buffers  # in place, no rebuild
    assert [r.logprobs for r in engine.generate(prompts_for(char_tokenizer), params, 1)] != before

    manifest = weight_manifest(state)
    path = tmp_path / "w.safetensors"
    corrupted = {k: v.clone() for k, v in state.items()}
    corrupted["model.layers.0.mlp.up_proj.weight"][0, 0] += 1e-3
    save_file(corrupted, str(path))
    with pytest.raises(WeightSyncError, match="1 tensors altered \\['model.layers.0.mlp.up_proj.weight'\\]"):
        engine.update_weights(path, 2, manifest=manifest)
    missing = {k: v for k, v in state.items() if "lm_head" not in k}
    with pytest.raises(WeightSyncError, match="1 missing"):
        engine.update_weights(missing, 2, manifest=manifest)
    assert engine.weight_version == 1


def test_bf16_engine_logprobs_close_to_fp32_trainer(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, dtype=torch.bfloat16, seed=1)
    rollouts = engine.generate(prompts_for(char_tokenizer), SamplingParams(n=2, max_tokens=8), 0)
    exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 0) for r in rollouts]
    batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    assert ((logp - batch.old_logprobs) * batch.response_mask).abs().max().item() < 0.1


def test_backend_choice_and_fallback_warning(char_tokenizer, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    from postrl.config.run import RolloutConfig
    from postrl.rollout.factory import rollout_worker_for_model

    llama = make_tiny_model("llama", char_tokenizer)
    assert isinstance(
        rollout_worker_for_model(RolloutConfig(), llama, char_tokenizer, "float32", 0), NativeRolloutWorker
    )
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(char_tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with caplog.at_level("WARNING"):
        worker = rollout_worker_for_model(RolloutConfig(), gpt2, char_tokenizer, "float32", 0)
    assert isinstance(worker, HFRolloutWorker) and "no native engine" in caplog.text
    with pytest.raises(ValueError, match="supports .* not 'gpt2'"):
        rollout_worker_for_model(RolloutConfig(backend="native"), gpt2, char_tokenizer, "float32", 0)
    out = worker.generate(prompts_for(char_tokenizer, ["1+1="]), SamplingParams(temperature=0.0, max_tokens=4), 0)
    assert len(out[0].response_ids) == len(out[0].logprobs) >= 1


def test_shared_system_prompt_prefilled_once_gives_same_tokens_and_logprobs(char_tokenizer):
    model = make_tiny_model("qwen2", char_tokenizer)
    system = "You are a careful calculator. Answer briefly.\n"
    texts = [system + q for q in ["12+34=", "7+5=", "123+456=", "9*9="]]
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, max_batch_size=16)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    shared = engine.generate(prompts_for(char_tokenizer, texts), params, 0)
    assert engine.stats["prefill_tokens"] < sum(len(char_tokenizer(t)["input_ids"]) for t in texts)
    hf = HFRolloutWorker(model, char_tokenizer).generate(prompts_for(char_tokenizer, texts), params, 0)
    assert seqs(shared) == seqs(hf)
    diff = max(abs(a - b) for r, h in zip(shared, hf) for a, b in zip(r.logprobs, h.logprobs))
    assert diff < 1e-5


def test_health_check_generates_and_finds_bad_weights(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    for engine in (NativeRolloutWorker.from_hf(model, char_tokenizer), HFRolloutWorker(model, char_tokenizer)):
        assert engine.health_check()
        out = engine.generate(
            [Prompt("1+1=", char_tokenizer("1+1=")["input_ids"])], SamplingParams(n=2, temperature=0.0, max_tokens=4), 0
        )
        assert len(out) == 2 and engine.health_check()  # the probe works with a cache already in use
    native = NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer)
    name = next(n for n in native.model.params if "norm" in n)
    native.model.params[name].fill_(float("nan"))
    assert native.health_check() is False  # the seed's bool; the reason one call away
    health = native.health()
    assert not health and health.reason == f"non-finite weights in ['{name}']"


def test_kv_cache_is_released_after_a_generate_unless_asked_to_keep_it(char_tokenizer):
    """With release_cache (the default) the KV cache is freed when generate returns, so that training
    in the same process gets the memory; the next call allocates it again and samples the same."""
    model = make_tiny_model("llama", char_tokenizer)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=3)
    released, kept = (NativeRolloutWorker.from_hf(model, char_tokenizer, release_cache=r) for r in (True, False))
    first = [r.response_ids for r in released.generate(prompts_for(char_tokenizer), params, 0)]
    assert released.cache is None
    assert [r.response_ids for r in released.generate(prompts_for(char_tokenizer), params, 0)] == first
    assert [r.response_ids for r in kept.generate(prompts_for(char_tokenizer), params, 0)] == first
    assert kept.cache is not None and kept.cache.slots >= 2


def test_a_concurrent_call_joins_the_running_loop_and_returns_before_it_ends(char_tokenizer):
    """B is called while A decodes: it joins A's loop (the cache grows in slots and length to take
    its longer prompt) and is answered while A still runs; both give exactly what they give alone."""
    model = make_tiny_model("llama", char_tokenizer)
    long_a = SamplingParams(temperature=0.0, max_tokens=40)
    short_b = SamplingParams(temperature=0.0, max_tokens=4)
    a, b = prompts_for(char_tokenizer, ["7+5="]), prompts_for(char_tokenizer, [TEXTS[-1] * 2])
    alone_a = NativeRolloutWorker.from_hf(model, char_tokenizer).generate(a, long_a, 0)
    alone_b = NativeRolloutWorker.from_hf(model, char_tokenizer).generate(b, short_b, 0)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, release_cache=False)
    b_answer: list = []
    b_returned = threading.Event()

    b_finished = threading.Event()

    def on_b_token(prompt_index, sample_index, token, logprob, top, finish):
        if finish is not None:
            b_finished.set()

    def call_b() -> None:
        b_answer.extend(engine.generate(b, short_b, 0, on_token=on_b_token))
        b_returned.set()

    waited_for_b = []

    def on_a_token(prompt_index, sample_index, token, logprob, top, finish):
        if not waited_for_b:
            waited_for_b.append(None)
            threading.Thread(target=call_b, daemon=True).start()
            deadline = time.monotonic() + 10
            while not engine._inbox and time.monotonic() < deadline:  # B is queued before A's next step
                time.sleep(0.001)
        elif len(waited_for_b) == 1 and b_finished.is_set():  # B's last token came in an earlier step
            waited_for_b.append(b_returned.wait(timeout=10) and finish is None)  # answered, A not done

    out_a = engine.generate(a, long_a, 0, on_token=on_a_token)
    assert waited_for_b == [None, True]  # B returned while A was still decoding
    assert seqs(out_a) == seqs(alone_a) and len(out_a[0].response_ids) == 40
    assert seqs(b_answer) == seqs(alone_b) and b_answer[0].prompt_index == 0
    assert engine.cache is not None and engine.cache.slots == 2 and engine.cache.max_len >= len(b[0].prompt_ids) + 4


def test_a_call_with_other_sampling_waits_for_the_loop_and_runs_after(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    greedy, sampled = SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.9, max_tokens=6)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer)
    started = threading.Event()
    results: dict[str, list] = {}

    def other() -> None:
        started.wait(10)
        results["sampled"] = engine.generate(prompts_for(char_tokenizer, ["hello"]), sampled, 0)

    thread = threading.Thread(target=other)
    thread.start()

    def hold(prompt_index, sample_index, token, logprob, top, finish):
        if not started.is_set():
            started.set()
            deadline = time.monotonic() + 10
            while not engine._inbox and time.monotonic() < deadline:
                time.sleep(0.001)

    results["greedy"] = engine.generate(prompts_for(char_tokenizer, ["7+5="]), greedy, 0, on_token=hold)
    thread.join(10)
    alone = NativeRolloutWorker.from_hf(model, char_tokenizer).generate(
        prompts_for(char_tokenizer, ["7+5="]), greedy, 0
    )
    assert seqs(results["greedy"]) == seqs(alone)
    assert len(results["sampled"]) == 1 and 1 <= len(results["sampled"][0].response_ids) <= 6


def test_a_loop_left_by_an_answered_caller_goes_on_in_the_helper_thread_which_stops_at_close(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer)
    short, long = SamplingParams(temperature=0.0, max_tokens=2), SamplingParams(temperature=0.0, max_tokens=30)
    answers: dict[str, list] = {}
    joined = threading.Event()

    def first_token(*event):
        if not joined.is_set():  # the long call is queued before the short one's next step
            threading.Thread(
                target=lambda: answers.update(long=engine.generate(prompts_for(char_tokenizer, ["hello"]), long, 0))
            ).start()
            deadline = time.monotonic() + 10
            while not engine._inbox and time.monotonic() < deadline:
                time.sleep(0.001)
            joined.set()

    answers["short"] = engine.generate(prompts_for(char_tokenizer, ["7+5="]), short, 0, on_token=first_token)
    deadline = time.monotonic() + 30
    while "long" not in answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(answers["long"][0].response_ids) == 30 and engine._helper is not None  # finished by the helper
    engine.close()
    engine._helper.join(10)
    assert not engine._helper.is_alive()
    again = engine.generate(prompts_for(char_tokenizer, ["7+5="]), short, 0)  # a lone call still runs, on its thread
    assert seqs(again) == seqs(answers["short"])
