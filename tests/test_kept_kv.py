"""The native engine keeps a finished sequence's K/V under its prompt's cache key and continues
the next call that extends it from there (a multi-turn episode's next turn): the same tokens and
logprobs as prefilling the whole context again, with only the new tokens prefilled."""

from __future__ import annotations

import pytest
import torch

from postrl.rollout.native import NativeRolloutWorker
from postrl.rollout.native.kv_cache import KeptCaches, KVCache
from postrl.types import Prompt, SamplingParams
from tests.conftest import make_tiny_model

GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6, stop_token_ids=())


@pytest.fixture
def engine(char_tokenizer) -> NativeRolloutWorker:
    return NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer, torch.float32)


def turns(engine: NativeRolloutWorker, tokenizer, keyed: bool) -> list[list[float]]:
    """Three turns of four episodes: each turn's prompt is the last context, its response and a new
    message; returns every turn's logprobs."""
    contexts = [tokenizer(f"{a}+{a}=")["input_ids"] for a in range(10, 14)]
    out = []
    for turn in range(3):
        prompts = [Prompt("", ids, cache_key=f"ep{i}" if keyed else None) for i, ids in enumerate(contexts)]
        rollouts = engine.generate(prompts, GREEDY, None)
        out.append([lp for r in rollouts for lp in r.logprobs])
        new = tokenizer(f" then {turn}:", add_special_tokens=False)["input_ids"]
        contexts = [r.prompt_ids + r.response_ids + new for r in rollouts]
    return out


def test_kept_kv_continues_each_episode_with_the_same_logprobs_and_prefills_only_the_new_tokens(engine, char_tokenizer):
    fresh = turns(engine, char_tokenizer, keyed=False)
    prefilled_fresh = engine.stats["prefill_tokens"]
    engine.stats["prefill_tokens"] = 0
    kept = turns(engine, char_tokenizer, keyed=True)
    for a, b in zip(fresh, kept):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert engine.kept.hits == 8 and engine.kept.misses == 4  # turns 2 and 3 of 4 episodes; turn 1 had none
    # turns 2-3 prefill the 8-token new message and the last response token (its K/V was never written)
    first_turn = sum(len(char_tokenizer(f"{a}+{a}=")["input_ids"]) for a in range(10, 14))
    assert engine.stats["prefill_tokens"] == first_turn + 2 * 4 * (8 + 1)
    assert prefilled_fresh > 2 * engine.stats["prefill_tokens"]


def test_a_prompt_that_does_not_extend_the_kept_tokens_is_prefilled_whole(engine, char_tokenizer):
    ids = char_tokenizer("12+12=")["input_ids"]
    first = engine.generate([Prompt("", ids, cache_key="ep")], GREEDY, None)[0]
    other = char_tokenizer("13+13=")["input_ids"] + first.response_ids + [5]
    fresh = engine.generate([Prompt("", other)], GREEDY, None)[0]
    engine.generate([Prompt("", ids, cache_key="ep")], GREEDY, None)
    again = engine.generate([Prompt("", other, cache_key="ep")], GREEDY, None)[0]
    assert again.response_ids == fresh.response_ids
    assert engine.kept.hits == 0 and engine.kept.misses == 3  # nothing kept yet; the same prompt again; another


def test_kept_caches_drop_the_oldest_past_their_byte_budget():
    cache = KVCache(2, 2, 1, 8, 4, torch.float32, torch.device("cpu"))
    one = 2 * 2 * 1 * 4 * 4 * 4  # layers x (k, v) x heads x 4 tokens x head_dim x 4 bytes
    kept = KeptCaches(max_bytes=2 * one)
    for key in ("a", "b", "c"):
        kept.keep(key, [1, 2, 3, 4], cache, 0, 0)
    assert list(kept.entries) == ["b", "c"] and kept.bytes == 2 * one
    assert kept.take("b", [1, 2, 3, 4, 5]) is not None and "b" not in kept.entries
    assert kept.take("c", [1, 2, 3, 4]) is None  # nothing left to prefill: not a continuation
