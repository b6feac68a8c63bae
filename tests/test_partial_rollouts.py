"""Weights that arrive while the native engine generates: in-flight sequences pause at the next
decode iteration, the weights are swapped, generation continues from the prefix; every token's
version says which weights produced it (and, with ``kv_after_update=keep``, which cache it read)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from postrl.rollout.native import NativeRolloutWorker
from postrl.train.logprobs import token_logprobs
from postrl.types import Prompt, SamplingParams
from tests.conftest import make_tiny_model

MAX_TOKENS = 12
UPDATE_AFTER = 4  # tokens of sample 0 sampled before the new weights arrive


def _generate_across_an_update(tokenizer, kv_after_update):
    old, new = make_tiny_model("llama", tokenizer, seed=0), make_tiny_model("llama", tokenizer, seed=1)
    engine = NativeRolloutWorker.from_hf(old, tokenizer, seed=5, kv_after_update=kv_after_update)
    prompts = [Prompt(text=t, prompt_ids=tokenizer(t)["input_ids"]) for t in ("12+34=", "7+5=")]
    sync: list[threading.Thread] = []

    def on_token(prompt, sample, token, logprob, top, finish):
        if sync or (prompt, sample) != (0, 0) or len(seen) + 1 < UPDATE_AFTER:
            seen.append(token) if (prompt, sample) == (0, 0) else None
            return
        seen.append(token)
        thread = threading.Thread(target=engine.update_weights, args=(new.state_dict(), 1))
        thread.start()
        sync.append(thread)
        while engine._pending is None:  # the weights are waiting before the next decode iteration
            time.sleep(0.001)

    seen: list[int] = []
    params = SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=())
    rollouts = engine.generate(prompts, params, weight_version=0, on_token=on_token)
    sync[0].join(timeout=30)
    assert engine.weight_version == 1 and engine.updates_in_flight == 1
    return rollouts, old, new


def _logprobs_under(model, rollout):
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return logp[0, len(rollout.prompt_ids) - 1 :].tolist()


def _continued(rollouts):
    """Rollouts that were still generating when the weights changed."""
    out = [r for r in rollouts if r.logprob_versions is not None and 1 in r.logprob_versions]
    assert out, "no sequence was in flight at the update"
    return out


@pytest.mark.parametrize("kv_after_update", ["recompute", "keep"])
def test_a_partial_rollout_records_the_version_of_every_token(char_tokenizer, kv_after_update):
    rollouts, old, new = _generate_across_an_update(char_tokenizer, kv_after_update)
    first = rollouts[0]
    # sample 0: UPDATE_AFTER tokens from version 0, the rest from version 1; max_tokens counts across the pause
    cut = first.logprob_versions.index(1)
    assert cut == UPDATE_AFTER and first.logprob_versions == [0] * cut + [1] * (len(first.response_ids) - cut)
    assert first.weight_version == 0  # the rollout's version is the oldest behind any of its tokens
    for r in _continued(rollouts):
        assert len(r.response_ids) <= MAX_TOKENS
        cut = r.logprob_versions.index(1)
        old_lp, new_lp = _logprobs_under(old, r), _logprobs_under(new, r)
        assert r.logprobs[:cut] == pytest.approx(old_lp[:cut], abs=1e-4)  # produced by the old weights
        if kv_after_update == "recompute":
            # the prefix was recomputed: every later token is exactly what the new weights compute
            assert r.kv_versions is None or all(k == v for k, v in zip(r.kv_versions, r.logprob_versions))
            assert r.token_versions() == r.logprob_versions
            assert r.logprobs[cut:] == pytest.approx(new_lp[cut:], abs=1e-4)
        else:
            # the kept cache came from version 0: the tokens after the update read it, and say so
            assert r.kv_versions[cut:] == [0] * (len(r.response_ids) - cut)
            assert r.token_versions() == [0] * len(r.response_ids)
            gap = max(abs(a - b) for a, b in zip(r.logprobs[cut:], new_lp[cut:]))
            assert gap > 1e-3  # neither the old nor the new weights' logprobs: a mixed policy


def test_weights_arriving_between_generates_apply_at_once(char_tokenizer):
    engine = NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer)
    engine.update_weights(make_tiny_model("llama", char_tokenizer, seed=1).state_dict(), 3)
    prompt = Prompt(text="1+1=", prompt_ids=char_tokenizer("1+1=")["input_ids"])
    (r,) = engine.generate([prompt], SamplingParams(n=1, max_tokens=4), weight_version=3)
    assert r.weight_version == 3 and r.logprob_versions is None and engine.updates_in_flight == 0
    with pytest.raises(RuntimeError, match="asked to generate with weight_version 2, engine holds 3"):
        engine.generate([prompt], SamplingParams(n=1, max_tokens=4), weight_version=2)
    assert engine.generate([prompt], SamplingParams(n=1, max_tokens=4), weight_version=None)[0].weight_version == 3
