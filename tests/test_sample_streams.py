"""Per-sample random streams (issue 43, part 4): a sample's tokens are a function of its stream,
not of what it was batched with, the order calls joined the engine, or the threads: sampled
(temperature 1) episodes scheduled individually give the same tokens run after run, on 1 and 2
threads, and the same as lockstep."""

from __future__ import annotations

import random

import pytest
import torch

from postrl.data.dataset import PromptDataset
from postrl.data.sampler import DatasetDraw
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
from postrl.rollout.agentic.individual import Individual
from postrl.rollout.agentic.lockstep import Lockstep
from postrl.rollout.native import NativeRolloutWorker
from postrl.rollout.streams import derive, uniforms
from postrl.types import Prompt, SamplingParams
from tests.test_episode_scheduling import Log, SlowToolEnv, rows

SAMPLED = SamplingParams(n=2, temperature=1.0, max_tokens=6)
M32 = 0xFFFFFFFF


def lowbias32(x: int) -> int:
    """The reference hash in plain Python integers (Wellons' lowbias32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def reference_uniform(key: int, position: int, lane: int) -> float:
    high, low = (key >> 31) & 0x7FFFFFFF, key & 0x7FFFFFFF
    h = lowbias32(((position * 2 + lane) & M32) ^ lowbias32(low ^ lowbias32(high)))
    return (h >> 8) / (1 << 24)


def test_uniforms_are_the_32_bit_hash_of_key_and_position_whatever_the_batch():
    keys = [0, 1, derive(7, 3), (1 << 62) - 1, derive(123456789, 0, 5)]
    positions = [0, 5, 17, 1000, 2**31 - 1]
    got = uniforms(torch.tensor(keys), torch.tensor(positions))
    want = [[reference_uniform(k, p, lane) for lane in (0, 1)] for k, p in zip(keys, positions, strict=True)]
    assert got.tolist() == want  # exact: the int64 split products are 32-bit arithmetic
    alone = uniforms(torch.tensor(keys[2:3]), torch.tensor(positions[2:3]))
    assert alone.tolist() == got[2:3].tolist()  # a row's uniforms do not depend on the others
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0
    many = uniforms(torch.arange(20_000), torch.zeros(20_000, dtype=torch.long))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.002


def test_derive_names_distinct_streams_and_takes_any_integer():
    assert derive(5, 0) == derive(5, 0) and derive(5, 0) != derive(5, 1) != derive(6, 1)
    assert derive(5, 0, 1) != derive(5, 1, 0)
    assert all(0 <= derive(s, k) < 1 << 62 for s in (-1, 0, 2**70) for k in range(3))
    assert len({derive(0, k) for k in range(10_000)}) == 10_000


def test_the_draw_names_each_prompt_s_stream_by_seed_and_place_and_resumes_it():
    dataset = PromptDataset([Prompt(f"p{i}", [i + 1]) for i in range(5)], [])
    draw = DatasetDraw(dataset, seed=3, shuffle=True)
    first = draw.next_prompts(3)
    state = draw.state_dict()
    rest = draw.next_prompts(4)  # into the second epoch
    assert [p.stream for p in first + rest] == [derive(3, k) for k in range(7)]
    again = DatasetDraw(dataset, seed=3, shuffle=True)
    again.load_state_dict(state)
    assert [p.stream for p in again.next_prompts(4)] == [p.stream for p in rest]
    assert dataset.prompts[0].stream is None  # the dataset's prompts are not changed


def sampled_episodes(model_and_tokenizer, scheduling: str, delays: list[float], threads: int):
    model, tokenizer = model_and_tokenizer
    engine = NativeRolloutWorker.from_hf(model, tokenizer)
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=6, max_context=1024, end_on_turn_length=False)
    runner = EpisodeRunner(
        lambda p, sp: engine.generate(p, sp, None),
        lambda: SlowToolEnv(Log()),
        tokenizer,
        limits,
        schedule=Individual(joins_calls=True) if scheduling == "individual" else Lockstep(),
    )
    prompts = [Prompt(r["prompt"], [], columns=r, stream=derive(11, i)) for i, r in enumerate(rows(delays))]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [(r.prompt_ids, r.response_ids) for r in runner.run(prompts, SAMPLED)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_sampled_individual_episodes_give_the_same_tokens_whatever_the_timing_and_threads(model_and_tokenizer, threads):
    shuffled = random.Random(0)
    runs = []
    for _ in range(2):  # the tools answer in another order each time: the turns join the engine in another order
        delays = [shuffled.choice([0.0, 0.01, 0.05, 0.1]) for _ in range(4)]
        runs.append(sampled_episodes(model_and_tokenizer, "individual", delays, threads))
    lockstep = sampled_episodes(model_and_tokenizer, "lockstep", [0.0] * 4, 3 - threads)
    assert runs[0] == runs[1] == lockstep
    responses = [tuple(ids) for _, ids in runs[0]]
    assert len(set(responses)) > len(responses) // 2  # sampled, not greedy: the episodes differ


def test_a_prompt_samples_alike_alone_and_batched_with_others(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = NativeRolloutWorker.from_hf(model, tokenizer)
    prompts = [Prompt(f"q{i}", tokenizer.encode(f"question number {i}"), stream=derive(4, i)) for i in range(4)]
    together = engine.generate(prompts, SAMPLED, None)
    alone = engine.generate([prompts[2]], SAMPLED, None)
    assert [r.response_ids for r in together[4:6]] == [r.response_ids for r in alone]
    reordered = engine.generate(prompts[::-1], SAMPLED, None)
    assert [r.response_ids for r in reordered[2:4]] == [r.response_ids for r in together[4:6]]


def test_a_call_with_a_seed_samples_alike_whatever_came_before(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = NativeRolloutWorker.from_hf(model, tokenizer)
    unnamed = [Prompt("q", tokenizer.encode("a question")), Prompt("r", tokenizer.encode("another one"))]
    seeded = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=9)
    first = [r.response_ids for r in engine.generate(unnamed, seeded, None)]
    engine.generate(unnamed, SAMPLED, None)  # no seed: draws its streams from the engine's generator
    assert [r.response_ids for r in engine.generate(unnamed, seeded, None)] == first
    unseeded = [[r.response_ids for r in engine.generate(unnamed, SAMPLED, None)] for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # without a seed the generator moves on


def test_an_individually_scheduled_agent_run_repeats_token_for_token_on_1_and_2_threads(tmp_path):
    """``postrl train`` on a two-turn environment whose steps answer after random delays, with the
    default individual scheduling: the same config and seed give the same tokens and rewards, and the
    same metrics up to the rounding of the engine's logprobs, which varies with the batch the turns
    were computed in (with rollout.exact they are equal bit for bit: tests/test_exact.py)."""
    import json

    from postrl.cli import main
    from tests.test_third_day import agent_run

    # timings, and the largest engine-trainer logprob gap, which is the rounding itself
    timing = ("time/", "throughput/", "perf/", "_s", "memory/", "logprob_diff")
    runs = []
    before = torch.get_num_threads()
    try:
        for i, threads in enumerate((1, 2, 2)):
            torch.set_num_threads(threads)
            args = agent_run(
                tmp_path,
                f"name=run{i}",
                "steps=2",
                "agent.env=tests.fault_envs:JitteryGuess",
                "agent.max_context=120",
                "rollout.temperature=1.0",
            )
            assert main(args) == 0
            run = tmp_path / "runs" / f"run{i}"
            samples = [
                [(s["prompt_index"], s["response"], s["reward"]) for s in map(json.loads, open(f))]
                for f in sorted((run / "samples").glob("step_*.jsonl"))
            ]
            metrics = [
                {k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)}
                for line in (run / "metrics.jsonl").read_text().splitlines()
            ]
            runs.append((samples, metrics))
    finally:
        torch.set_num_threads(before)
    assert runs[0][0] == runs[1][0] == runs[2][0]  # every sample's tokens and reward
    for _, metrics in runs[1:]:
        assert len(metrics) == len(runs[0][1]) == 2
        for got, want in zip(metrics, runs[0][1], strict=True):
            assert got.keys() == want.keys()
            assert got == {k: pytest.approx(v, rel=1e-3, abs=1e-5) for k, v in want.items()}
    responses = [r for step in runs[0][0] for _, r, _ in step]
    assert len(responses) == 16 and len(set(responses)) > 4  # sampled: the episodes differ
