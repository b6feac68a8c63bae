"""rollout.backend=vllm against a real vLLM server; skipped when the vLLM environment is absent."""

from __future__ import annotations

import pytest
import torch

from postrl.models.weights import WeightSyncError, dedupe_tied, weight_manifest
from postrl.rollout.vllm_backend import vllm_python
from postrl.train.logprobs import token_logprobs
from postrl.types import Experience, ExperienceBatch, Prompt, SamplingParams
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="no vLLM environment (run scripts/setup_vllm.sh)")


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory, char_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(char_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=char_tokenizer.bos_token_id,
        eos_token_id=char_tokenizer.eos_token_id,
        pad_token_id=char_tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
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
