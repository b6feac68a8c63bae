"""The Experience Buffer: staleness bound (drop or refuse), replay with seeded sampling and a reuse
limit, and its state in checkpoints."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl.buffer import ExperienceBuffer, StaleExperienceError
from postrl.config.off_policy import BufferConfig, ReplayConfig
from postrl.types import Experience


def exp(version: int, group: int | None = None, tag: int = 0, versions: list[int] | None = None) -> Experience:
    return Experience([1], [2, 3], [0.0, 0.0], float(tag), 0.0, version, group_id=group, logprob_versions=versions)


def test_on_policy_buffer_hands_out_each_put_once_and_refuses_stale():
    buf = ExperienceBuffer()
    first, second = [exp(3, g) for g in range(3)], [exp(3, 0)]
    buf.put(first)
    buf.put(second)
    taken = buf.get(None, current_version=3)  # None: the oldest put
    assert taken.experiences == first and taken.lags == [0, 0, 0] and len(buf) == 1
    assert buf.get(None, current_version=3).experiences == second and buf.get(None, 3).experiences == []
    buf.put([exp(2)])
    with pytest.raises(StaleExperienceError, match=r"from weight_version \[2\], current is 3 \(buffer.max_staleness=0"):
        buf.get(None, current_version=3)


def test_stale_experiences_are_dropped_and_counted():
    buf = ExperienceBuffer(max_staleness=1, on_stale="drop")
    buf.put([exp(5, 0), exp(4, 1), exp(3, 2)])
    taken = buf.get(None, current_version=5)
    assert [e.weight_version for e in taken.experiences] == [5, 4] and taken.lags == [0, 1]
    assert taken.dropped == 1 and buf.dropped_count == 1
    assert taken.metrics() == {"buffer/lag_mean": 0.5, "buffer/lag_max": 1.0, "buffer/dropped": 1.0}


def test_a_partial_rollouts_lag_is_its_oldest_token():
    buf = ExperienceBuffer(max_staleness=1, on_stale="drop")
    buf.put([exp(6, 0, versions=[4, 6]), exp(6, 1, versions=[5, 6])])
    taken = buf.get(None, current_version=6)
    assert taken.lags == [1] and taken.dropped == 1


def test_group_ids_are_made_unique_across_puts():
    buf = ExperienceBuffer(max_staleness=2, replay=ReplayConfig(capacity_steps=2, reuse_limit=2))
    buf.put([exp(0, 0), exp(0, 0), exp(0, 1)])
    buf.get(None, current_version=0)
    buf.put([exp(1, 0), exp(1, 1), exp(1, 1)])
    taken = buf.get(None, current_version=1)  # step 2's window: both puts
    pairs = {(e.weight_version, e.group_id) for e in taken.experiences}
    assert len(pairs) == 4 and len({g for _, g in pairs}) == 4


def test_replay_samples_seeded_whole_groups_within_capacity_and_reuse_limit():
    def run(seed):
        buf = ExperienceBuffer(max_staleness=2, replay=ReplayConfig(capacity_steps=2, reuse_limit=2), seed=seed)
        drawn = []
        for step in range(4):
            buf.put([exp(step, g, tag=10 * step + g) for g in range(4) for _ in range(2)])  # 4 groups of 2
            taken = buf.get(4, current_version=step)
            assert len(taken.experiences) == 4  # two whole groups
            tags = [int(e.reward) for e in taken.experiences]
            assert tags[0] == tags[1] and tags[2] == tags[3]  # a group's samples come together
            assert all(t // 10 >= step - 1 for t in tags)  # only the last two puts are kept
            drawn.append(tags)
        return drawn, buf

    drawn, buf = run(0)
    assert drawn == run(0)[0] and drawn != run(1)[0]
    # each experience is handed out at most reuse_limit times
    uses: dict[int, int] = {}
    for tags in drawn:
        for t in set(tags):
            uses[t] = uses.get(t, 0) + 1
    assert max(uses.values()) <= 2
    assert buf.got_count == 16 and buf.put_count == 32


def test_replay_window_follows_the_trainers_steps_when_batches_are_put_ahead():
    """Async mode puts batches before their step: the k-th get samples only batches 1..k (within
    capacity), so nothing put ahead is pushed out or trained early; an experience that ages past
    max_staleness in the window is dropped and counted, even with on_stale=wait."""
    buf = ExperienceBuffer(max_staleness=1, replay=ReplayConfig(capacity_steps=2, reuse_limit=3))
    buf.put([exp(0, g, tag=10 + g) for g in range(2)])  # batch 1
    buf.put([exp(0, g, tag=20 + g) for g in range(2)])  # batch 2, put ahead
    first = buf.get(None, current_version=0)
    assert sorted(int(e.reward) for e in first.experiences) == [10, 11]
    buf.put([exp(1, g, tag=30 + g) for g in range(2)])  # batch 3, put ahead
    second = buf.get(None, current_version=1)  # window: batches 1 and 2
    assert sorted(int(e.reward) for e in second.experiences) == [10, 11, 20, 21]
    third = buf.get(None, current_version=2)  # window: batches 2 and 3; batch 2 (version 0) lags 2 > 1
    assert sorted(int(e.reward) for e in third.experiences) == [30, 31] and third.dropped == 2


def test_replay_state_round_trips_through_a_checkpoint_bit_exactly():
    def fresh():
        return ExperienceBuffer(max_staleness=3, replay=ReplayConfig(capacity_steps=3, reuse_limit=3), seed=7)

    live = fresh()
    for step in range(3):
        live.put([exp(step, g, tag=10 * step + g) for g in range(3) for _ in range(2)])
        live.get(4, step)
    saved = io.BytesIO()
    torch.save(live.state_dict(), saved)
    saved.seek(0)
    resumed = fresh()
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    assert (resumed.put_count, resumed.got_count, len(resumed)) == (live.put_count, live.got_count, len(live))
    for step in range(3, 6):
        for buf in (live, resumed):
            buf.put([exp(step, g, tag=10 * step + g) for g in range(3) for _ in range(2)])
        assert live.get(4, step).experiences == resumed.get(4, step).experiences


def test_rewind_puts_the_buffer_back_at_its_mark_without_copying_experiences():
    """An abandoned sync step (a put, a get) leaves no trace: the state and the next draws are those
    of a buffer that never saw it; the mark holds the same experience objects, not copies."""

    def fresh():
        return ExperienceBuffer(max_staleness=3, replay=ReplayConfig(capacity_steps=3, reuse_limit=2), seed=7)

    live, untouched = fresh(), fresh()
    for buf in (live, untouched):
        buf.put([exp(0, g, tag=g) for g in range(3) for _ in range(2)])
        buf.get(4, 0)
    live.mark()
    held = [entry.experience for entry, _ in live._mark.entries]
    assert all(a is b for a, b in zip(held, [x.experience for x in live._entries], strict=True))
    live.put([exp(1, g, tag=10 + g) for g in range(3) for _ in range(2)])
    live.get(4, 1)
    assert live.state_dict() != untouched.state_dict()
    live.rewind()
    assert live.state_dict() == untouched.state_dict()
    for step in (1, 2):
        for buf in (live, untouched):
            buf.put([exp(step, g, tag=10 * step + g) for g in range(3) for _ in range(2)])
        assert live.get(4, step).experiences == untouched.get(4, step).experiences
    with pytest.raises(RuntimeError, match="rewind\\(\\) without a mark\\(\\)"):
        fresh().rewind()


def test_replay_capacity_must_fit_the_staleness_bound():
    with pytest.raises(ValueError, match="capacity_steps=3 keeps samples up to 2 versions old"):
        BufferConfig(max_staleness=1, replay={"capacity_steps": 3})


@settings(max_examples=200, deadline=None)
@given(
    max_staleness=st.integers(0, 3),
    on_stale=st.sampled_from(["drop", "wait"]),
    script=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(1, 5)), min_size=1, max_size=30),
)
def test_no_experience_handed_out_ever_lags_more_than_max_staleness(max_staleness, on_stale, script):
    """A producer puts batches generated ``behind`` versions back (possibly too stale); the trainer
    moves ``advance`` versions between gets. Whatever the interleaving, nothing handed out lags
    more than the bound, and every experience is handed out or dropped, never both, never twice."""
    buf = ExperienceBuffer(max_staleness=max_staleness, on_stale=on_stale)
    version, serial, handed, dropped = 0, 0, [], 0
    for behind, advance, size in script:
        batch = []
        for _ in range(size):
            serial += 1
            batch.append(exp(max(0, version - behind), tag=serial))
        buf.put(batch)
        version += advance
        try:
            taken = buf.get(None, version)
        except StaleExperienceError:
            assert on_stale == "wait"
            return
        assert all(lag <= max_staleness for lag in taken.lags)
        assert all(version - e.weight_version <= max_staleness for e in taken.experiences)
        handed += [int(e.reward) for e in taken.experiences]
        dropped += taken.dropped
    while len(buf):
        taken = buf.get(None, version)
        handed += [int(e.reward) for e in taken.experiences]
        dropped += taken.dropped
    assert len(handed) == len(set(handed)) and len(handed) + dropped == serial
