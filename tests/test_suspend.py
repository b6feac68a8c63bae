"""In-flight trajectories across a checkpoint: the native engine suspends a generate when asked
(the unfinished samples come back ``suspended`` with their tokens so far), the continuation goes on
from the exact token prefix with what is left of ``max_tokens``, and the async producer holds a
suspended batch in its checkpoint and continues it afterwards (after a restart too)."""

from __future__ import annotations

import dataclasses
import threading
from collections import deque

import pytest
import torch

from postrl.controller.async_pipelines import Producer
from postrl.controller.generated import Generated
from postrl.controller.pipeline import Batch, ProducedBatch
from postrl.controller.step_metrics import StageTimer
from postrl.rollout.continuation import continue_rollouts, merged
from postrl.rollout.native import NativeRolloutWorker
from postrl.types import Experience, Prompt, RewardResult, Rollout, SamplingParams
from tests.conftest import make_tiny_model

MAX_TOKENS = 10
SUSPEND_AFTER = 4  # tokens sampled (all samples together) before the suspend arrives


def _prompts(tokenizer):
    return [Prompt(text=t, prompt_ids=tokenizer(t)["input_ids"]) for t in ("12+34=", "7+5=", "99+1=")]


def _suspended_generate(engine, prompts, params):
    count = [0]

    def on_token(prompt, sample, token, logprob, top, finish):
        count[0] += 1
        if count[0] == SUSPEND_AFTER:
            assert engine.suspend()  # a generate is running: it stops before the next decode step

    return engine.generate(prompts, params, weight_version=0, on_token=on_token)


def test_a_suspended_generate_continues_to_exactly_the_uninterrupted_tokens(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer, seed=0)
    # 2 slots for 6 samples: when the suspend comes, some samples have tokens, some never started
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, max_batch_size=2)
    prompts = _prompts(char_tokenizer)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=())
    whole = engine.generate(prompts, greedy, weight_version=0)
    parts = _suspended_generate(engine, prompts, greedy)
    assert len(parts) == len(whole) == 6
    reasons = [r.finish_reason for r in parts]
    assert reasons.count("suspended") >= 4
    lengths = sorted(len(r.response_ids) for r in parts if r.finish_reason == "suspended")
    assert lengths[0] == 0 and lengths[-1] > 0  # not yet admitted, and cut mid-response
    assert not engine.suspend()  # nothing runs now
    done = continue_rollouts(
        lambda p, sp: engine.generate(p, sp, weight_version=0), prompts, parts, greedy, char_tokenizer
    )
    for a, b in zip(done, whole, strict=True):
        assert (a.prompt_index, a.prompt_ids, a.response_ids, a.finish_reason) == (
            b.prompt_index,
            b.prompt_ids,
            b.response_ids,
            b.finish_reason,
        )
        assert len(a.response_ids) <= MAX_TOKENS  # the budget counts across the pause
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.text == b.text


def test_a_continuation_under_new_weights_records_every_tokens_version(char_tokenizer):
    engine = NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer, seed=0), char_tokenizer, seed=2)
    prompts = _prompts(char_tokenizer)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=())
    parts = _suspended_generate(engine, prompts, params)
    cut = {i: len(r.response_ids) for i, r in enumerate(parts) if r.finish_reason == "suspended"}
    assert cut and all(0 < n < MAX_TOKENS for n in cut.values())
    engine.update_weights(make_tiny_model("llama", char_tokenizer, seed=1).state_dict(), 1)
    done = continue_rollouts(lambda p, sp: engine.generate(p, sp, None), prompts, parts, params, char_tokenizer)
    for i, n in cut.items():
        r = done[i]
        assert r.response_ids[:n] == parts[i].response_ids and r.logprobs[:n] == parts[i].logprobs
        rest = len(r.response_ids) - n
        assert r.logprob_versions == [0] * n + [1] * rest and r.weight_version == 0
        assert r.kv_versions == [0] * n + [1] * rest  # the prefix was prefilled again by version 1
    untouched = [i for i in range(len(parts)) if i not in cut]
    assert all(done[i] is parts[i] for i in untouched)


def test_merged_keeps_versions_and_refuses_a_full_budget(char_tokenizer):
    a = Rollout(0, [1], [5, 6], [-0.1, -0.2], "", "suspended", 3)
    b = Rollout(0, [1, 5, 6], [7], [-0.3], "", "stop", 4, logprob_versions=[4], kv_versions=[4])
    m = merged(a, b, char_tokenizer)
    assert (m.response_ids, m.logprobs, m.finish_reason) == ([5, 6, 7], [-0.1, -0.2, -0.3], "stop")
    assert (m.weight_version, m.logprob_versions, m.kv_versions, m.token_versions()) == (
        3,
        [3, 3, 4],
        [3, 3, 4],
        [3, 3, 4],
    )
    full = Rollout(0, [1], [5, 6], [-0.1, -0.2], "", "suspended", 3)
    with pytest.raises(ValueError, match="already holds max_tokens=2"):
        continue_rollouts(lambda p, sp: [], [Prompt("", [1])], [full], SamplingParams(max_tokens=2), char_tokenizer)


def test_a_generated_batch_round_trips_through_a_weights_only_checkpoint(tmp_path):
    batch = Generated(
        7,
        [Prompt("1+1=", [1, 2], {"answer": "2"}, "f.jsonl:3")],
        [Rollout(0, [1, 2], [3], [-0.5], "x", "suspended", 2, top_logprobs=[[(3, -0.5)]], logprob_versions=[2])],
        12.5,
    )
    torch.save({"in_flight": batch.state_dict()}, tmp_path / "s.pt")
    loaded = Generated.of_state(torch.load(tmp_path / "s.pt", weights_only=True)["in_flight"])
    assert loaded.number == 7 and loaded.prompts == batch.prompts and loaded.suspended
    assert loaded.rollouts[0].response_ids == [3] and loaded.rollouts[0].logprob_versions == [2]
    assert [tuple(t) for t in loaded.rollouts[0].top_logprobs[0]] == [(3, -0.5)]


class _FakeEngines:
    """A producer's steps whose first generation runs until a suspend arrives."""

    def __init__(self) -> None:
        self.generating, self.stop_asked = threading.Event(), threading.Event()
        self.calls: list[tuple[int, bool]] = []

    def begin(self, number: int, timer: StageTimer, alone: bool) -> Batch:
        self.calls.append((number, False))
        if len(self.calls) == 1:
            self.generating.set()
            assert self.stop_asked.wait(10)
            rollouts = [Rollout(0, [1], [4], [0.0], "", "suspended", 0)]
        else:
            rollouts = [Rollout(0, [1], [4, 9], [0.0, 0.0], "", "stop", 0)]
        return Batch(Generated(number, [Prompt("p", [1])], rollouts, 1.0), timer, alone)

    def resume(self, suspended: Generated) -> Batch:
        self.calls.append((suspended.number, True))
        rollouts = [
            Rollout(0, [1], r.response_ids + [9], [0.0] * (len(r.response_ids) + 1), "", "stop", 0)
            for r in suspended.rollouts
        ]
        return Batch(dataclasses.replace(suspended, rollouts=rollouts), StageTimer(), True)

    def score_batch(self, batch: Batch) -> list[RewardResult]:
        return [RewardResult(1.0) for _ in batch.generated.rollouts]

    def finish(self, batch: Batch, rewards: list[RewardResult]):
        generated = batch.generated
        exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, 1.0, 1.0, 0) for r in generated.rollouts]
        return exps, ProducedBatch({"batch": float(generated.number)})

    def suspend(self) -> bool:
        self.stop_asked.set()
        return True


def _producer(engines: _FakeEngines, delivered: list, total: int = 2) -> Producer:
    return Producer(engines, delivered.append, lambda k: True, total, 0, threading.Condition())


def test_a_checkpoint_suspends_the_producers_generation_and_saves_it():
    engines, delivered = _FakeEngines(), []
    producer = _producer(engines, delivered)
    producer.start()
    assert engines.generating.wait(10)
    with producer.paused():  # would wait forever without the suspend: the fake generates until asked
        state = producer.state_dict()
    assert state["in_flight"] is not None and state["in_flight"]["number"] == 1 and state["produced"] == 0
    assert producer.next_report().values == {"batch": 1.0} and producer.next_report().values == {"batch": 2.0}
    producer.stop()
    assert engines.calls == [(1, False), (1, True), (2, False)]  # batch 1 continued, not generated again
    assert [e.response_ids for batch in delivered for e in batch] == [[4, 9], [4, 9]]
    # after a restart the saved batch is continued first
    again, delivered_again = _FakeEngines(), []
    restarted = _producer(again, delivered_again)
    restarted.load_state_dict(state)
    restarted.start()
    assert restarted.next_report().values == {"batch": 1.0}
    assert restarted.next_report().values == {"batch": 2.0}
    restarted.stop()
    assert again.calls[0] == (1, True) and deque(delivered_again[0])[0].response_ids == [4, 9]
