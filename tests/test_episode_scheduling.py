"""Episodes scheduled individually: a fast episode does not wait for a slow one's tool, the
trajectories are those of lockstep scheduling token for token (greedy), turns are batched for an
engine that does not join calls, a failing episode stops the others with every environment closed,
and ``max_concurrent`` bounds the episodes in flight."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from postrl.config.run import ConfigError
from postrl.rollout.agentic.env import StepResult
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
from postrl.rollout.agentic.individual import Individual
from postrl.rollout.agentic.lockstep import Lockstep
from postrl.rollout.agentic.turn_batcher import TurnBatcher
from postrl.rollout.native import NativeRolloutWorker
from postrl.types import Prompt, Rollout, SamplingParams
from tests.chat_templates import family_tokenizer

LIMITS = EpisodeLimits(max_turns=3, max_tokens_per_turn=6, max_context=1024, end_on_turn_length=False)
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6)


@dataclass
class Log:
    """What the environments did, with times: (episode name, event, time)."""

    events: list[tuple[str, str, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, event: str) -> None:
        with self.lock:
            self.events.append((name, event, time.monotonic()))

    def times(self, name: str, event: str) -> list[float]:
        return [t for n, e, t in self.events if n == name and e == event]


class SlowToolEnv:
    """Answers every turn after ``row['delay']`` seconds (a remote tool), never done by itself."""

    tools: list = []

    def __init__(self, log: Log) -> None:
        self.log, self.name, self.delay = log, "", 0.0

    def reset(self, row: dict) -> list[dict]:
        self.name, self.delay = row["name"], float(row["delay"])
        if row.get("fail"):
            raise AssertionError("unreachable: a failing row is refused before its reset")
        self.log.add(self.name, "reset")
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> StepResult:
        self.log.add(self.name, "step")
        time.sleep(self.delay)
        self.log.add(self.name, "answered")
        return StepResult([{"role": "user", "content": f"tool says {len(action)}"}], reward=1.0)

    def close(self) -> None:
        self.log.add(self.name, "close")


def run(model_and_tokenizer, rows, scheduling, joins=True, max_concurrent=None, limits=LIMITS, log=None):
    model, tokenizer = model_and_tokenizer
    engine = NativeRolloutWorker.from_hf(model, tokenizer)
    log = log or Log()
    calls: list[int] = []

    def generate(prompts: list[Prompt], sp: SamplingParams) -> list[Rollout]:
        calls.append(len(prompts))
        return engine.generate(prompts, sp, None)

    runner = EpisodeRunner(
        generate,
        lambda: SlowToolEnv(log),
        tokenizer,
        limits,
        schedule=Individual(joins, max_concurrent) if scheduling == "individual" else Lockstep(),
    )
    prompts = [Prompt(r["prompt"], [], columns=r) for r in rows]
    return runner.run(prompts, GREEDY), log, calls


def rows(delays):
    return [{"name": f"e{i}", "prompt": f"question {i}", "delay": d} for i, d in enumerate(delays)]


def test_a_fast_episode_finishes_while_a_slow_one_waits_on_its_first_tool_call(model_and_tokenizer):
    slow_tool = 0.5
    _, log, _ = run(model_and_tokenizer, rows([0.0, slow_tool]), "individual")
    fast_done, slow_first_answer = log.times("e0", "answered")[-1], log.times("e1", "answered")[0]
    assert len(log.times("e0", "step")) == 3 and fast_done < slow_first_answer  # 3 turns in the slow one's first
    _, log, _ = run(model_and_tokenizer, rows([0.0, slow_tool]), "lockstep")
    fast_done, slow_first_answer = log.times("e0", "answered")[-1], log.times("e1", "answered")[0]
    assert fast_done > slow_first_answer + slow_tool  # lockstep: each fast turn waits for the slow tool


@pytest.mark.parametrize("joins", [True, False], ids=["engine-joins-calls", "turns-batched"])
def test_individual_trajectories_are_lockstep_token_for_token(model_and_tokenizer, joins):
    delays = [0.0, 0.05, 0.2, 0.01, 0.1, 0.0]
    individual, log, calls = run(model_and_tokenizer, rows(delays), "individual", joins=joins)
    lockstep, _, _ = run(model_and_tokenizer, rows(delays), "lockstep")
    assert [r.prompt_index for r in individual] == list(range(len(delays)))
    for a, b in zip(individual, lockstep, strict=True):
        assert (a.prompt_ids, a.response_ids, a.loss_mask) == (b.prompt_ids, b.response_ids, b.loss_mask)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert a.episode is not None and len(a.episode.turns) == 3 and a.episode.finish_reason == "max_turns"
    assert all(len(log.times(f"e{i}", "close")) == 1 for i in range(len(delays)))
    if joins:  # each turn is its own call, joined in the engine
        assert calls == [1] * 3 * len(delays)
    else:  # the turns that waited together went in one call: fewer calls than turns
        assert len(calls) < 3 * len(delays) and sum(calls) == 3 * len(delays)


def test_the_turn_batcher_merges_waiting_turns_and_hands_errors_to_each():
    seen: list[int] = []
    gate = threading.Event()

    def generate(prompts: list[Prompt], sp: SamplingParams) -> list[Rollout]:
        seen.append(len(prompts))
        gate.wait(5)  # the first call holds the engine while the others queue
        if any(p.text == "bad" for p in prompts):
            raise RuntimeError("engine failed")
        return [Rollout(i, p.prompt_ids, [7], [-0.1], "x", "stop", 0) for i, p in enumerate(prompts)]

    batcher = TurnBatcher(generate)
    out: dict[str, object] = {}

    def ask(text: str) -> None:
        try:
            out[text] = batcher([Prompt(text, [len(text)])], SamplingParams(max_tokens=4))[0].prompt_ids
        except RuntimeError as exc:
            out[text] = str(exc)

    first = threading.Thread(target=ask, args=("a",))
    first.start()
    while not seen:
        time.sleep(0.001)
    others = [threading.Thread(target=ask, args=(t,)) for t in ("bb", "ccc", "bad")]
    for t in others:
        t.start()
    time.sleep(0.2)  # all three queued behind the first call
    gate.set()
    for t in [first, *others]:
        t.join(5)
    assert seen == [1, 3] and batcher.batches == 2
    assert out == {"a": [1], "bb": "engine failed", "ccc": "engine failed", "bad": "engine failed"}


def test_a_failing_episode_stops_the_run_and_every_environment_is_closed(model_and_tokenizer):
    bad = rows([0.05, 0.05, 0.05])
    bad[1]["prompt"] = "word " * 600  # renders past max_context: refused by name
    log = Log()
    with pytest.raises(ConfigError, match="renders to .* tokens: agent.max_context=1024 leaves no room"):
        run(model_and_tokenizer, bad, "individual", log=log)
    deadline = time.monotonic() + 10  # the others stop after the call they are in, then close
    while len(log.times("e0", "close")) + len(log.times("e2", "close")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    resets = sorted(n for n, e, _ in log.events if e == "reset")
    assert resets == ["e0", "e1", "e2"]
    assert sorted(n for n, e, _ in log.events if e == "close") == resets
    assert len(log.times("e0", "step")) < 3  # stopped before its last turn


def test_max_concurrent_episodes_bounds_the_episodes_in_flight(model_and_tokenizer):
    limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=2, max_context=1024, end_on_turn_length=False)
    _, log, _ = run(model_and_tokenizer, rows([0.1] * 4), "individual", max_concurrent=2, limits=limits)
    spans = sorted((log.times(f"e{i}", "reset")[0], log.times(f"e{i}", "close")[0]) for i in range(4))
    overlaps = [sum(1 for s, e in spans if s <= start < e) for start, _ in spans]
    assert max(overlaps) == 2  # never three at once, but two did run together


def test_an_episode_spanning_weight_versions_is_as_old_as_its_oldest_token():
    """buffer.max_staleness counts from an episode's oldest token: its first turn by version 2, the
    environment's tokens in between, its second turn by version 4."""
    from postrl.rollout.agentic.chat import ChatRenderer
    from postrl.rollout.agentic.trajectory import sample_rollout
    from postrl.types.episode import Episode, TrajectorySample

    sample = TrajectorySample([1, 2, 3])
    sample.add([10, 11], [-0.1, -0.2], [2, 2], [2, 2], generated=True)
    sample.add([20], [0.0], [2], [2], generated=False)
    sample.add([12, 13], [-0.3, -0.4], [4, 4], [3, 4], generated=True)
    r = sample_rollout(0, sample, Episode([], [], 1.0, "stop"), 0, ChatRenderer(family_tokenizer("qwen2.5")))
    assert r.weight_version == 2 and r.logprob_versions == [2, 2, 2, 4, 4] and r.kv_versions == [2, 2, 2, 3, 4]
    assert r.token_versions() == [2, 2, 2, 3, 4] and r.loss_mask == [1, 1, 0, 1, 1]
