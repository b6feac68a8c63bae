"""Reward functions, the mixed reward, and killable scoring processes."""

from __future__ import annotations

import re
import time

import pytest

from postrl.config.run import RewardConfig
from postrl.reward.pool import ScoringPool
from postrl.reward.rules import format_reward, length_penalty
from postrl.reward.service import LocalRewardService, ScoreRequest
from postrl.reward.verifiers import exact_match, extract_final_answer, math_equal


def test_answer_extraction():
    assert extract_final_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_final_answer("<answer> 42 </answer>") == "42"
    assert extract_final_answer("no answer") is None


def test_exact_match_and_math_verify():
    assert exact_match("", "<answer>632</answer>", answer="632") == 1.0
    assert exact_match("", "<answer>633</answer>", answer="632") == 0.0
    assert math_equal("", "the answer is \\boxed{\\frac{1}{2}}", answer="0.5") == 1.0
    assert math_equal("", "<answer>2/4</answer>", answer="\\frac{1}{2}") == 1.0
    assert math_equal("", "<answer>3</answer>", answer="4") == 0.0
    with pytest.raises(KeyError, match="no 'answer' column"):
        exact_match("", "<answer>1</answer>")


def test_format_and_length_rules():
    pattern = re.compile(r"^\s*<answer>.*?</answer>\s*$", re.DOTALL)
    assert format_reward(pattern, "<answer>5</answer>") == 1.0
    assert format_reward(pattern, "5") == 0.0
    assert length_penalty(10, 0) == 0.0 and length_penalty(8, 10) == 0.0 and length_penalty(15, 10) == -0.5


def service(**kw) -> LocalRewardService:
    return LocalRewardService(RewardConfig(**kw))


def custom(function: str) -> dict:
    return {"name": "verifiable", "type": "custom", "function": function}


def test_mixed_reward_weights_and_components():
    svc = service(
        components=[
            {"name": "verifiable", "type": "exact_match"},
            {"name": "format", "type": "format", "weight": 0.5},
            {"name": "length", "type": "length", "weight": 2.0, "target_tokens": 4},
        ],
        num_workers=1,
    )
    try:
        out = svc.score_batch(
            [
                ScoreRequest("1+1=", "<answer>2</answer>", {"answer": "2"}, response_tokens=6),
                ScoreRequest("1+1=", "3", {"answer": "2"}, response_tokens=2),
            ]
        )
    finally:
        svc.close()
    assert out[0].components == {"verifiable": 1.0, "format": 1.0, "length": -0.5}
    assert out[0].reward == pytest.approx(1.0 + 0.5 - 1.0)
    assert out[1].reward == 0.0 and not out[1].unscorable


def test_custom_function_by_import_path_gets_columns():
    svc = service(components=[custom("tests.reward_fns:uses_columns")], num_workers=1)
    try:
        assert svc.score("p", "the 7", answer="7", bonus=0.5).reward == pytest.approx(1.5)
    finally:
        svc.close()


def test_unimportable_function_fails_at_start():
    with pytest.raises(ValueError, match="function='no_such_pkg.rewards:score': no module named 'no_such_pkg'"):
        service(components=[custom("no_such_pkg.rewards:score")])
    with pytest.raises(ValueError, match=r"module 'tests.reward_fns' \(.*reward_fns.py\) has no 'nope'; it has: "):
        service(components=[custom("tests.reward_fns:nope")])


def test_raising_none_and_dead_functions_are_unscorable_with_error():
    for fn, message in [("raises", "ValueError: bad response"), ("cannot_score", "returned None"), ("exits", "died")]:
        svc = service(components=[custom(f"tests.reward_fns:{fn}")], num_workers=1)
        try:
            res = svc.score("p", "r")
        finally:
            svc.close()
        assert res.unscorable and res.reward is None and message in res.error


def test_timeout_kills_worker_keeps_order_and_recovers():
    jobs = [
        {"fn": "tests.reward_fns:sleeps_when_asked", "prompt": "", "response": r, "columns": {}}
        for r in ["a", "SLEEP", "b", "c", "SLEEP", "d"]
    ]
    with ScoringPool(num_workers=2, timeout_s=1.0) as pool:
        start = time.monotonic()
        results = pool.map(jobs)
        elapsed = time.monotonic() - start
        assert [r.value for r in results] == [1.0, None, 1.0, 1.0, None, 1.0]
        assert results[1].timed_out and "timed out after 1s" in results[1].error
        assert elapsed < 10
        assert pool.restarts == 2
        again = pool.map([{"fn": "tests.reward_fns:length_score", "prompt": "", "response": "xyz", "columns": {}}])
        assert again[0].value == 3.0
        pids = [w.proc.pid for w in pool._workers]
    import os

    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_function_writing_to_fd_1_does_not_corrupt_results():
    jobs = [{"fn": "tests.reward_fns:writes_to_fd1", "prompt": "", "response": "r", "columns": {}} for _ in range(3)]
    with ScoringPool(num_workers=1, timeout_s=5.0) as pool:
        assert [r.value for r in pool.map(jobs)] == [2.0, 2.0, 2.0]
