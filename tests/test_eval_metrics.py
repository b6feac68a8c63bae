"""pass@k and maj@k against hand-computed values, and the harness's figures over prompts."""

from __future__ import annotations

import pytest

from postrl.run.eval_metrics import default_ks, maj_at_k, pass_at_k
from postrl.run.harness import PromptOutcome, figures


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 1, 4, 1.0),  # k = n: any correct sample is drawn
        (4, 0, 4, 0.0),  # no correct sample: 0 at every k
        (4, 0, 1, 0.0),
        (16, 2, 4, 1 - 1001 / 1820),  # 1 - C(14,4)/C(16,4)
        (16, 16, 1, 1.0),
        (3, 2, 2, 1.0),  # n - c = 1 < k: no all-wrong pair
    ],
)
def test_pass_at_k_matches_the_hand_computed_value(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_share_of_correct_samples():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_maj_at_k_counts_votes_and_splits_ties():
    answers = ["3", "4", "3", None]
    correct = [True, False, True, False]
    assert maj_at_k(answers, correct, 4) == 1.0  # "3" has 2 votes, "4" one, None does not vote
    assert maj_at_k(answers, correct, 2) == 0.5  # "3" and "4" tie: half of the tied answers are right
    assert maj_at_k(answers, correct, 1) == 1.0
    assert maj_at_k(["5", "5", "6", "6"], [False, False, True, True], 4) == 0.5
    assert maj_at_k(["5", "5", "6", "6"], [False, False, True, True], 3) == 0.0
    assert maj_at_k(["1", "2", "3"], [False, False, True], 3) == pytest.approx(1 / 3)
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # no answer at all: no vote, wrong


def test_maj_at_k_refuses_k_past_the_samples():
    with pytest.raises(ValueError, match="maj@3"):
        maj_at_k(["1", "2"], [True, False], 3)


def test_default_ks():
    assert default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(1) == [1]


def test_figures_average_over_prompts_and_keep_greedy_apart():
    outcomes = [
        PromptOutcome("a", greedy=True, answers=["1", "1", "2", "2"], correct=[True, True, False, False]),
        PromptOutcome("a", greedy=False, answers=["7", None, "7", "8"], correct=[False, False, False, False]),
    ]
    f = figures(outcomes, [1, 4])
    assert f.prompts == 2 and f.greedy == 0.5
    assert f.mean_at_n == pytest.approx((0.5 + 0.0) / 2)
    assert f.pass_at == {1: pytest.approx(0.25), 4: pytest.approx(0.5)}  # (0.5 + 0) / 2, (1 + 0) / 2
    assert f.maj_at == {1: pytest.approx(0.5), 4: pytest.approx(0.25)}  # tie 1/2 at k=4 for the first prompt


def test_the_console_line_names_each_task_and_eval_set():
    from postrl.run.metrics import console_line
    from postrl.types import StepMetrics

    values = {"val/accuracy": 0.5, "val/gcd/accuracy": 0.25, "val/chain_sum/accuracy": 0.75,
              "val/harder/chain_sum/accuracy": 0.1, "val/harder/accuracy": 0.1}  # fmt: skip
    line = console_line(StepMetrics(step=3, weight_version=3, values=values))
    assert line == "step 3 | val acc 0.500 | val chain_sum 0.750, gcd 0.250, harder 0.100"


def test_the_report_draws_a_panel_per_task_and_set_and_the_curriculum():
    from postrl.run.report import RunMetrics, per_task_panels

    rows = [{"step": 1, "accuracy/gcd": 0.1, "curriculum/gcd/level": 0.0},
            {"step": 2, "val/accuracy": 0.2, "val/gcd/accuracy": 0.3, "val/harder/gcd/accuracy": 0.1}]  # fmt: skip
    panels = {title: lines for title, lines, _ in per_task_panels([RunMetrics("r", rows)])}
    assert panels == {
        "held-out accuracy by set and task": [("val/gcd/accuracy", "gcd"), ("val/harder/gcd/accuracy", "harder/gcd")],
        "training accuracy by task": [("accuracy/gcd", "gcd")],
        "curriculum level": [("curriculum/gcd/level", "gcd")],
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n": 0}, "--n 0: give at least 1"),
        ({"ks": [4]}, "--k 4 needs sampled responses"),
        ({"url": "http://127.0.0.1:9"}, "--url needs --model FOLDER"),
    ],
)
def test_eval_options_that_cannot_work_are_refused_by_name(options, message):
    from postrl.config.run import ConfigError
    from postrl.run.evaluate import SampledEval

    with pytest.raises(ConfigError, match=message):
        SampledEval(**options).checked(None)
