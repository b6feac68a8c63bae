"""Several engines in child processes behind one pool: spreading prompts, broadcast weight sync
with a checksum, and recovery from engines killed mid-generate and mid-transfer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from postrl.config.run import RolloutConfig
from postrl.models.loading import load_causal_lm
from postrl.models.weights import WeightSyncError, dedupe_tied, weight_manifest
from postrl.rollout.factory import EngineSpec
from postrl.rollout.host import RolloutEngineHost
from postrl.rollout.pool import RolloutPool
from postrl.rollout.weight_transport import BroadcastTransport, DirectTransport
from postrl.types import Prompt, SamplingParams
from postrl.workers.process import ProcessHandle
from tests.engine_hosts import SlowHost

CONFIG = RolloutConfig(backend="native", device="cpu", max_tokens=6)
SP = SamplingParams(n=3, temperature=1.0, max_tokens=6)


def starter(model_dir, host=RolloutEngineHost, slow=()):
    def start(i: int) -> ProcessHandle:
        cls = SlowHost if i in slow else host
        return ProcessHandle(f"rollout engine {i}", cls, EngineSpec(CONFIG, str(model_dir), "float32", 100 + i, 1))

    return start


def prompts(tokenizer, count=6):
    return [Prompt(t, tokenizer(t)["input_ids"]) for t in [f"{a}+{a}=" for a in range(10, 10 + count)]]


def new_weights(model_dir, scale=1.01):
    model = load_causal_lm(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    state = dedupe_tied(model.state_dict())
    return state, weight_manifest(state)


def versions(pool):
    return [slot.handle.attribute("weight_version") for slot in pool.engines]


@pytest.mark.slow
def test_prompts_spread_by_outstanding_work_and_groups_stay_together(tiny_model_dir, char_tokenizer):
    pool = RolloutPool(starter(tiny_model_dir), 2, DirectTransport())
    try:
        ps = prompts(char_tokenizer)
        ps[0] = Prompt("1" * 30, char_tokenizer("1" * 30)["input_ids"])  # one large prompt
        plan = pool._assign(ps, list(range(6)), SP)
        # work = n x (prompt + max_tokens): 3 x 37 = 111 for the long prompt, 3 x 13 = 39 for the others;
        # 0 -> e0 (111); 1, 2, 3 -> e1 (39, 78, 117); 4 -> e0 (150); 5 -> e1 (156)
        assert [len(p.prompt_ids) for p in ps[:2]] == [31, 7]
        assert list(plan.values()) == [[0, 4], [1, 2, 3, 5]]
        out = pool.generate(ps, SP, 0)
        assert [r.prompt_index for r in out] == [i for i in range(6) for _ in range(3)]
    finally:
        pool.close()


def tamper_with_buckets(monkeypatch, tamper) -> None:
    """``tamper(i, buffer)`` sees each bucket the sender packs (counted from 0) before it is sent."""
    from postrl.rollout import broadcast

    pack, count = broadcast.pack, [0]

    def packed(*args):
        buffer = pack(*args)
        tamper(count[0], buffer)
        count[0] += 1
        return buffer

    monkeypatch.setattr(broadcast, "pack", packed)


@pytest.mark.slow
def test_broadcast_sync_reaches_every_engine_and_a_corrupted_tensor_is_refused(
    tiny_model_dir, char_tokenizer, monkeypatch
):
    state, manifest = new_weights(tiny_model_dir)
    pool = RolloutPool(starter(tiny_model_dir), 2, BroadcastTransport(bucket_bytes=4096, timeout_s=30))
    try:
        pool.update_weights(state, 1, manifest)
        assert versions(pool) == [1, 1]
        flipped = lambda i, buffer: buffer.__setitem__(7, buffer[7] ^ 0xFF) if i == 2 else None  # noqa: E731
        tamper_with_buckets(monkeypatch, flipped)
        state2, manifest2 = new_weights(tiny_model_dir, 1.02)
        with pytest.raises(WeightSyncError, match="refused by 2 engine"):
            pool.update_weights(state2, 2, manifest2)
        assert versions(pool) == [1, 1]  # both keep serving the version they had
        assert pool.generate(prompts(char_tokenizer, 2), SP, 1)
    finally:
        pool.close()


@pytest.mark.slow
def test_engine_killed_mid_transfer_leaves_others_on_new_version_and_comes_back(
    tiny_model_dir, char_tokenizer, monkeypatch
):
    state, manifest = new_weights(tiny_model_dir)
    pool = RolloutPool(starter(tiny_model_dir), 3, BroadcastTransport(bucket_bytes=2048, timeout_s=30))
    try:
        pool.update_weights(*new_weights(tiny_model_dir, 0.99)[:1], 1, None)
        victim = pool.engines[1].handle
        tamper_with_buckets(monkeypatch, lambda i, buffer: victim.kill() if i == 3 else None)
        started = time.monotonic()
        pool.update_weights(state, 2, manifest)
        assert time.monotonic() - started < 60
        assert not victim.alive() and pool.restarts == 1
        assert versions(pool) == [2, 2, 2]
        # the restarted engine holds exactly the new weights: same greedy answer as the others
        greedy = SamplingParams(n=1, temperature=1.0, top_k=1, max_tokens=6)
        answers = [
            slot.handle.call("generate", prompts(char_tokenizer, 1), greedy, 2)[0].response_ids for slot in pool.engines
        ]
        assert answers[0] == answers[1] == answers[2]
    finally:
        pool.close()


@pytest.mark.slow
def test_engine_killed_mid_generate_is_replaced_and_its_prompts_requeued(tiny_model_dir, char_tokenizer):
    state, manifest = new_weights(tiny_model_dir)
    pool = RolloutPool(starter(tiny_model_dir, slow=(1,)), 2, DirectTransport())
    try:
        pool.update_weights(state, 1, manifest)
        victim = pool.engines[1].handle
        threading.Timer(0.7, victim.kill).start()
        out = pool.generate(prompts(char_tokenizer), SP, 1)
        assert not victim.alive() and pool.restarts == 1 and pool.requeued_prompts == 3
        assert [r.prompt_index for r in out] == [i for i in range(6) for _ in range(3)]  # none lost, none twice
        assert all(r.weight_version == 1 for r in out)
        assert versions(pool) == [1, 1]
    finally:
        pool.close()


def test_rollout_schedule_grows_the_pool_between_steps_on_the_current_weights(
    tmp_path, tiny_model_dir, arithmetic_jsonl
):
    from postrl.config.loading import build_config
    from postrl.run.train_runner import train

    config = build_config(
        {
            "name": "scaled",
            "output_dir": str(tmp_path),
            "steps": 3,
            "prompts_per_step": 4,
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_files": [str(arithmetic_jsonl)]},
            "rollout": {"n": 2, "max_tokens": 6},
            "reward": {
                "components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]
            },
            "train": {"lr": 1e-2, "mini_batch_size": 8, "micro_batch_size": 8},
            "logging": {"trackers": ["jsonl"]},
            "scheduler": {"rollout_schedule": {2: 3, 3: 2}},
        }
    )
    seen = []
    controller = train(config, on_step=lambda m: seen.append(m.step)).controller
    pool = controller.parts.rollout
    assert seen == [1, 2, 3] and len(pool.engines) == 2  # 1 engine, 3 from step 2, 2 from step 3
    assert [slot.index for slot in pool.engines] == [0, 1] and pool.engines_started == 3
    # the engine added before step 2 was given that version's weights before it served
    assert pool.weight_version == 3 and all(slot.handle.obj.weight_version == 3 for slot in pool.engines)


@pytest.mark.slow
def test_an_engine_in_a_child_process_takes_weights_and_a_suspend_beside_its_generate(tiny_model_dir, char_tokenizer):
    from postrl.rollout.host import ENGINE_SIDE_CALLS

    handle = ProcessHandle(
        "rollout engine 0",
        RolloutEngineHost,
        EngineSpec(CONFIG, str(tiny_model_dir), "float32", 7, 1),
        side_calls=ENGINE_SIDE_CALLS,
    )
    try:
        assert handle.concurrent
        state, _ = new_weights(tiny_model_dir, scale=1.0)  # the same weights under new versions: same speed
        long = SamplingParams(n=8, temperature=1.0, max_tokens=100, stop_token_ids=())
        ps = prompts(char_tokenizer, 16)
        handle.attribute("weight_version")  # started: the generate below is timed alone
        began = time.monotonic()
        handle.call("generate", ps, long, None)
        took = time.monotonic() - began
        future = handle.call_async("generate", ps, long, None)
        time.sleep(took / 3)
        handle.call("update_weights", state, 1)  # the side lane: returns once swapped in mid-generate
        assert not future.done()
        crossed = [r for r in future.result() if r.logprob_versions and 1 in r.logprob_versions]
        assert crossed and all(r.logprob_versions[0] == 0 and r.kv_versions[0] == 0 for r in crossed)
        future = handle.call_async("generate", ps, long, None)
        time.sleep(took / 3)
        assert handle.call("suspend")  # the side lane: the generate returns at its next decode step
        suspended = [r for r in future.result() if r.finish_reason == "suspended"]
        assert suspended and all(len(r.response_ids) < 100 for r in suspended)
    finally:
        handle.close()


def test_the_engines_counters_reach_the_step_as_what_changed_since_the_last_step():
    """The native engine counts prefill and decode seconds; the pool sums its engines' counters and
    reports what changed since it was last asked, never a negative change (a replaced engine
    starts again from 0)."""
    from postrl.rollout.common import EngineBase
    from postrl.workers.handles import InProcessHandle

    class Counting(EngineBase):
        def __init__(self) -> None:
            self.count = {"rollout/prefill_s": 1.0}

        def counters(self) -> dict[str, float]:
            return dict(self.count)

    engines = [Counting(), Counting()]
    pool = RolloutPool(lambda i: InProcessHandle(engines[i], f"e{i}"), 2, DirectTransport())
    assert pool.counters() == {"rollout/prefill_s": 2.0}
    engines[0].count["rollout/prefill_s"] = 1.5
    assert pool.counters() == {"rollout/prefill_s": 0.5}
    engines[1].count["rollout/prefill_s"] = 0.0  # replaced: its count starts again
    assert pool.counters() == {"rollout/prefill_s": 0.0}
    pool.engines[1].handle.kill()  # lost after its step: left out, the step's figures still come
    assert pool.counters() == {"rollout/prefill_s": 0.0}


def test_the_native_engine_counts_its_prefill_and_decode(tiny_model_dir, char_tokenizer):
    from postrl.rollout.native import NativeRolloutWorker

    engine = NativeRolloutWorker.from_hf(load_causal_lm(str(tiny_model_dir)), char_tokenizer)
    assert engine.counters() == {"rollout/prefill_s": 0.0, "rollout/decode_s": 0.0, "rollout/updates_mid_generate": 0.0}
    engine.generate(prompts(char_tokenizer, 2), SP, 0)
    counted = engine.counters()
    assert counted["rollout/prefill_s"] > 0 and counted["rollout/decode_s"] > 0
