"""rollout.backend=vllm against a real vLLM server; skipped when the vLLM environment is absent."""

from __future__ import annotations

import pytest
import torch

from postrl.models.weights import WeightSyncError, dedupe_tied, weight_manifest
from postrl.rollout.vllm_backend import vllm_python
from postrl.train.logprobs import token_logprobs
from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams
from tests.conftest import hf_greedy

pytestmark = [  # each test starts a vLLM server (tens of seconds): the full suite's, not the fast tier's
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM environment (run scripts/setup_vllm.sh)"),
    pytest.mark.slow,
]


def tiny_llama(tokenizer, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory, char_tokenizer):
    model = tiny_llama(char_tokenizer)
    out = tmp_path_factory.mktemp("vllm_tiny")
    model.save_pretrained(out, safe_serialization=True)
    char_tokenizer.save_pretrained(out)
    return model, out


def test_vllm_backend_generates_with_logprobs_and_syncs_weights(vllm_model, char_tokenizer):
    from postrl.rollout.vllm_backend import VLLMRolloutWorker

    model, folder = vllm_model
    worker = VLLMRolloutWorker(folder, char_tokenizer, dtype="float32", max_model_len=256)
    try:
        assert worker.health_check()
        texts = ["12+34=", "hello"]
        prompts = [Prompt(t, char_tokenizer(t)["input_ids"]) for t in texts]
        greedy = worker.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), 0)
        for text, r in zip(texts, greedy):
            assert (r.response_ids, r.finish_reason) == hf_greedy(model, char_tokenizer, text, 8)
        sampled = worker.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1), 0)
        assert len(sampled) == 6
        exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 0) for r in sampled]
        batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        assert ((logp - batch.old_logprobs) * batch.response_mask).abs().max().item() < 1e-3

        new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in dedupe_tied(model.state_dict()).items()}
        worker.update_weights(new_state, 1, manifest=weight_manifest(new_state))
        after = worker.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), 1)
        assert [r.logprobs for r in after] != [r.logprobs for r in greedy]
        bad = dict(weight_manifest(new_state))
        bad["model.norm.weight"] = "float32:128:00000000"
        with pytest.raises(WeightSyncError):
            worker.update_weights(new_state, 2, manifest=bad)
        assert worker.weight_version == 1
    finally:
        worker.close()
    assert not worker.health_check()


def sampled_gap(worker, model, tokenizer, version: int) -> float:
    """The largest gap between the server's sampled-token logprobs and ``model``'s."""
    prompts = [Prompt(t, tokenizer(t)["input_ids"]) for t in ("12+34=", "hello")]
    rollouts = worker.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=1), version)
    exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 0) for r in rollouts]
    batch = ExperienceBatch.from_experiences(exps, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, target_mask=batch.response_mask)
    return float(((logp - batch.old_logprobs) * batch.response_mask).abs().max())


def test_a_synced_model_with_tied_embeddings_samples_with_the_new_head(tmp_path, char_tokenizer):
    """SmolLM2 and the demo model tie the head to the embeddings: vLLM's CPU backend packs the
    head once at load, and a reload (which loads the embedding only) must pack it again, or the
    server samples with the old head (measured: logprobs 1.2 off the synced model's)."""
    from postrl.rollout.vllm_backend import VLLMRolloutWorker

    model = tiny_llama(char_tokenizer, tied=True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    char_tokenizer.save_pretrained(tmp_path)
    worker = VLLMRolloutWorker(tmp_path, char_tokenizer, dtype="float32", max_model_len=256)
    try:
        assert sampled_gap(worker, model, char_tokenizer, 0) < 1e-4
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.05 * torch.randn_like(model.model.embed_tokens.weight))
        state = dedupe_tied(model.state_dict())
        assert "lm_head.weight" not in state  # the sync carries the shared tensor once
        worker.update_weights(state, 1, manifest=weight_manifest(state))
        assert sampled_gap(worker, model, char_tokenizer, 1) < 1e-4
    finally:
        worker.close()


def _generating(worker, steps: int = 10) -> bool:
    """The server is in the middle of a batch: it has taken ``steps`` engine steps of it."""
    health = worker.control.get(worker.url + "/health").json()
    return health["generating"] and health["steps"] >= steps


def _in_background(fn):
    import threading

    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()))
    thread.start()
    return thread, out


def test_vllm_takes_weights_mid_batch_and_suspends_a_batch_to_be_continued(vllm_model, char_tokenizer):
    import time

    from postrl.rollout.continuation import continue_rollouts
    from postrl.rollout.vllm_backend import VLLMRolloutWorker

    model, folder = vllm_model
    worker = VLLMRolloutWorker(folder, char_tokenizer, dtype="float32", max_model_len=256)
    try:
        prompts = [Prompt(t, char_tokenizer(t)["input_ids"]) for t in ("12+34=", "hello", "7+5=")]
        long = SamplingParams(n=2, temperature=1.0, max_tokens=200, stop_token_ids=(), seed=3)
        thread, out = _in_background(lambda: worker.generate(prompts, long, None))
        while not _generating(worker):
            time.sleep(0.005)
        new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in dedupe_tied(model.state_dict()).items()}
        worker.update_weights(new_state, 1)  # returns once swapped in between two steps
        thread.join(120)
        rollouts = out["result"]
        assert worker.weight_version == 1 and len(rollouts) == 6
        crossed = [r for r in rollouts if r.logprob_versions and 0 in r.logprob_versions and 1 in r.logprob_versions]
        assert crossed, "no sample was generating when the weights arrived"
        for r in crossed:  # version 0 up to the swap, 1 after it; the kept cache is version 0's
            switch = r.logprob_versions.index(1)
            assert r.logprob_versions == [0] * switch + [1] * (len(r.response_ids) - switch)
            assert r.kv_versions == [0] * len(r.response_ids) and r.weight_version == 0

        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=200, stop_token_ids=())
        whole = worker.generate(prompts, greedy, None)
        thread, out = _in_background(lambda: worker.generate(prompts, greedy, None))
        while not _generating(worker):
            time.sleep(0.005)
        assert worker.suspend()
        thread.join(120)
        parts = out["result"]
        assert [r.finish_reason for r in parts].count("suspended") >= 1
        assert not worker.suspend()  # nothing runs now
        done = continue_rollouts(lambda p, sp: worker.generate(p, sp, None), prompts, parts, greedy, char_tokenizer)
        assert [r.response_ids for r in done] == [r.response_ids for r in whole]
    finally:
        worker.close()


def test_vllm_runs_multi_turn_episodes_token_for_token_like_the_native_engine(vllm_model, char_tokenizer):
    """Episodes through the vLLM backend (token ids in, token ids out; its prefix cache holds the
    earlier turns) give the native engine's trajectories, greedy."""
    from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.rollout.vllm_backend import VLLMRolloutWorker
    from tests.test_agentic import ScriptedEnv

    model, folder = vllm_model
    sampling = SamplingParams(n=2, temperature=0.0, max_tokens=6)  # turns cut at 6 tokens go on
    prompts = [Prompt(t, [], messages=None) for t in ("12+34=", "hello")]

    def episodes(generate):
        runner = EpisodeRunner(
            generate,
            lambda: ScriptedEnv(["go on", "again"]),
            char_tokenizer,
            EpisodeLimits(3, 6, 200, end_on_turn_length=False),
        )
        try:
            return runner.run(prompts, sampling)
        finally:
            runner.close()

    native = NativeRolloutWorker.from_hf(model, char_tokenizer, torch.float32)
    expected = episodes(lambda ps, sp: native.generate(ps, sp, None))
    worker = VLLMRolloutWorker(folder, char_tokenizer, dtype="float32", max_model_len=256)
    try:
        got = episodes(lambda ps, sp: worker.generate(ps, sp, None))
    finally:
        worker.close()
    assert [(r.prompt_ids, r.response_ids, r.loss_mask) for r in got] == [
        (r.prompt_ids, r.response_ids, r.loss_mask) for r in expected
    ]
    assert max(len(r.episode.turns) for r in got) == 3


def test_vllm_applies_synced_lora_adapters_as_the_trainer_and_native_engine_do(vllm_model, char_tokenizer):
    """An adapter sync reaches vLLM as a peft folder that its LoRA layers apply unmerged: the
    sampled tokens' logprobs are the LoRA trainer's, greedy text equals the native engine's with
    the same adapters, and a new version's adapters swap into a batch already generating."""
    import copy
    import time

    from postrl.config.run import LoraConfig
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.rollout.vllm_backend import VLLMRolloutWorker
    from postrl.train.lora import ADAPTER, adapter_state, apply_lora, lora_layers

    model, folder = vllm_model
    lora = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    policy = apply_lora(copy.deepcopy(model), lora).eval()

    def adapters(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in lora_layers(policy).values():
                for w in (layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight):
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.3)
        return {k: v.clone() for k, v in adapter_state(policy).items()}

    first = adapters(1)
    prompts = [Prompt(t, char_tokenizer(t)["input_ids"]) for t in ("12+34=", "hello", "7+5=")]
    worker = VLLMRolloutWorker(folder, char_tokenizer, dtype="float32", max_model_len=256, max_lora_rank=4)
    native = NativeRolloutWorker.from_hf(model, char_tokenizer)
    try:
        worker.update_weights(first, 1, manifest=weight_manifest(first))
        sampled = worker.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1), 1)
        exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 0.0, 0.0, 1) for r in sampled]
        batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
        with torch.no_grad():
            trainer, _ = token_logprobs(policy, batch.input_ids, batch.attention_mask, target_mask=batch.response_mask)
            base, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, target_mask=batch.response_mask)
        mask = batch.response_mask
        assert float(((trainer - batch.old_logprobs) * mask).abs().max()) < 1e-3
        assert float(((base - batch.old_logprobs) * mask).abs().max()) > 0.1  # the adapters took effect

        second = adapters(2)
        long = SamplingParams(n=2, temperature=1.0, max_tokens=200, stop_token_ids=(), seed=3)
        thread, out = _in_background(lambda: worker.generate(prompts, long, None))
        while not _generating(worker):
            time.sleep(0.005)
        worker.update_weights(second, 2)  # returns once the adapter is swapped in between two steps
        thread.join(120)
        crossed = [r for r in out["result"] if r.logprob_versions and {1, 2} <= set(r.logprob_versions)]
        assert crossed, "no sample was generating when the adapter arrived"

        native.update_weights(second, 2)
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        assert [r.response_ids for r in worker.generate(prompts, greedy, 2)] == [
            r.response_ids for r in native.generate(prompts, greedy, 2)
        ]
        q = "model.layers.0.self_attn.q_proj"
        wide = {**second, f"{q}.lora_A": torch.zeros(8, 128), f"{q}.lora_B": torch.zeros(128, 8)}
        with pytest.raises(RuntimeError, match="rank over the server's 4"):
            worker.update_weights(wide, 3)
        with pytest.raises(ValueError, match="needs lora_A, lora_B and lora_scale"):
            worker.update_weights({k: v for k, v in second.items() if k != f"{q}.lora_B"}, 3)
        assert worker.weight_version == 2
    finally:
        worker.close()
