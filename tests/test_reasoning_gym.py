"""reasoning-gym as a data source: the same problems on every build, held-out problems disjoint
from training (and the drop counted), the extracted-answer scorer, the config's errors."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from postrl.config.reasoning_gym import ReasoningGymConfig  # noqa: E402
from postrl.config.run import ConfigError, RunConfig  # noqa: E402
from postrl.data.dataset import DatasetError  # noqa: E402
from postrl.data.reasoning_gym import (  # noqa: E402
    build_gym_prompts,
    gym_held_out,
    held_out,
    shares,
    training_questions,
)
from postrl.reward.reasoning_gym import extract_answer, score  # noqa: E402

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # ~200 distinct problems


def gym(**over) -> ReasoningGymConfig:
    spec = {"tasks": [{"name": "chain_sum", "weight": 2, "config": SMALL}, {"name": "gcd"}], "size": 30, "val_size": 12}
    return ReasoningGymConfig.model_validate({**spec, **over})


def test_shares_split_by_weight_and_sum_to_the_total():
    g = gym()
    assert shares(g.tasks, 30) == [20, 10]
    assert shares(g.tasks, 31) == [21, 10]  # 20.67 and 10.33: the larger remainder gets the extra one
    assert shares(g.tasks, 1) == [1, 0]


def test_the_same_config_builds_the_same_problems(char_tokenizer):
    g = gym(chat_template=False)
    a = build_gym_prompts(g, char_tokenizer, g.seed, g.size, 512)
    b = build_gym_prompts(g, char_tokenizer, g.seed, g.size, 512)
    assert [(p.text, p.columns) for p in a.prompts] == [(p.text, p.columns) for p in b.prompts]
    assert [p.task_type for p in a.prompts].count("chain_sum") == 20
    first = a.prompts[0]
    assert first.text.startswith("State the final answer to the following arithmetic problem:")
    assert first.text.endswith("inside <answer> and </answer> tags, for example <answer>42</answer>.")
    assert first.columns["answer"] == str(first.columns["rg_entry"]["answer"])
    other_seed = build_gym_prompts(g, char_tokenizer, 7, g.size, 512)
    assert [p.text for p in other_seed.prompts] != [p.text for p in a.prompts]


def test_held_out_problems_never_repeat_a_training_question(char_tokenizer):
    g = gym(size=400, val_size=60, chat_template=False)  # 267 draws of ~200 chain_sum problems: overlap is certain
    train = training_questions(g)
    val, dropped = held_out(g, char_tokenizer, 512, train)
    questions = [p.columns["rg_entry"]["question"] for p in val.prompts]
    assert not set(questions) & train
    built, _ = held_out(g, char_tokenizer, 512, set())
    expected_drops = sum(p.columns["rg_entry"]["question"] in train for p in built.prompts)
    assert dropped == expected_drops > 0
    assert len(val) == 60 - dropped


def test_held_out_equal_to_training_is_refused(char_tokenizer):
    g = gym(val_seed=0, chat_template=False)  # the training seed: every held-out problem is a training one
    with pytest.raises(DatasetError, match="every held-out problem is also a training problem"):
        gym_held_out(g, char_tokenizer, 512, "data.reasoning_gym", lambda _: None)


def test_held_out_reports_how_many_it_dropped(char_tokenizer):
    lines = []
    g = gym(size=400, val_size=60, chat_template=False)
    gym_held_out(g, char_tokenizer, 512, "data.reasoning_gym", lines.append)
    assert lines and "held-out problems (seed 1);" in lines[0] and "dropped as also among the training" in lines[0]


ENTRY = {"question": "4 - 1 - 7 =", "answer": "-4", "metadata": {}}


def gym_score(response: str, scorer: str = "reasoning_gym", task: str = "chain_sum", entry=ENTRY) -> float:
    return score("q", response, rg_task=task, rg_config={}, rg_entry=entry, scorer=scorer)


def test_a_response_that_merely_contains_the_reference_earns_nothing():
    import reasoning_gym

    own = reasoning_gym.create_dataset("chain_sum", size=1, seed=0)
    assert own.score_answer("the answer is -4", ENTRY) > 0  # reasoning-gym's own partial credit
    assert gym_score("<answer>the answer is -4</answer>") == 0.0
    assert gym_score("the answer is -4") == 0.0  # no <answer> tag at all
    assert gym_score("I think -4. <answer>-4</answer>") == 1.0
    assert gym_score("<answer>3</answer> no wait <answer>-4</answer>") == 1.0  # the last tag counts
    assert gym_score("<answer>-4.00</answer>") == 1.0  # the task's own numeric tolerance


def test_the_tasks_own_partial_credit_stays_and_cascade_is_all_or_nothing():
    entry = {"question": "Spell this word backward (example: sun -> nus): ammonia", "answer": "ainomma", "metadata": {}}
    near = gym_score("<answer>ainommb</answer>", task="spell_backward", entry=entry)
    assert near == pytest.approx(6 / 7)  # spell_backward's own similarity credit
    assert gym_score("<answer>ainommb</answer>", "cascade", "spell_backward", entry) == 0.0
    assert gym_score("<answer>AINOMMA</answer>", "cascade", "spell_backward", entry) == 1.0
    assert gym_score("<answer> -4.0 </answer>", "cascade") == 1.0  # numeric equality
    assert gym_score("<answer>answer: -4</answer>", "cascade") == 0.0


def test_extract_answer():
    assert extract_answer("<answer> 12 </answer>") == "12"
    assert extract_answer("no tags") is None
    assert extract_answer("<answer>1</answer><answer>2</answer>") == "2"


def test_a_row_without_gym_columns_is_unscorable_with_a_reason():
    with pytest.raises(KeyError, match="rows made by data.reasoning_gym"):
        score("q", "<answer>1</answer>", answer="1")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="no task 'chainsum' \\(close: chain_sum"):
        RunConfig.model_validate({"data": {"reasoning_gym": {"tasks": [{"name": "chainsum"}]}}})
    with pytest.raises(ValueError, match="no reasoning-gym curriculum"):
        ReasoningGymConfig.model_validate({"tasks": [{"name": "gsm_symbolic", "level": 0}]})
    with pytest.raises(ValueError, match="past its last level 10"):
        ReasoningGymConfig.model_validate({"tasks": [{"name": "chain_sum", "level": 11}]})
    with pytest.raises(ValueError, match="no task has a level"):
        ReasoningGymConfig.model_validate({"tasks": [{"name": "chain_sum"}], "curriculum": {}})
    with pytest.raises(ValueError, match="set only one of data.train_files and data.reasoning_gym"):
        RunConfig.model_validate({"data": {"train_files": ["a.jsonl"], "reasoning_gym": {"tasks": [{"name": "gcd"}]}}})


def test_gym_data_defaults_to_the_gym_scorer_and_a_reward_section_wins():
    cfg = RunConfig.model_validate({"data": {"reasoning_gym": {"tasks": [{"name": "gcd"}]}}})
    assert [(c.name, c.type) for c in cfg.reward.components] == [("correct", "reasoning_gym")]
    own = RunConfig.model_validate(
        {
            "data": {"reasoning_gym": {"tasks": [{"name": "gcd"}]}},
            "reward": {"components": [{"name": "em", "type": "exact_match"}]},
        }
    )
    assert [c.type for c in own.reward.components] == ["exact_match"]
    assert ConfigError  # the config's error type (the CLI's message) is this ValueError subclass


def curriculum_stage(char_tokenizer, window=4, raise_at=0.75, lower_at=0.25, level=1):
    from postrl.controller.stages.curriculum import Curriculum
    from postrl.data.curriculum import LeveledDraw

    g = ReasoningGymConfig.model_validate({
        "tasks": [{"name": "chain_sum", "level": level}, {"name": "gcd"}], "size": 20, "chat_template": False,
        "curriculum": {"window": window, "raise_at": raise_at, "lower_at": lower_at},
    })  # fmt: skip
    draw = LeveledDraw(g, char_tokenizer, 512, seed=0, shuffle=True)
    return Curriculum(draw, g.curriculum, "correct", 1.0), draw


def scripted_groups(draw, outcomes: list[bool]):
    """One chain_sum prompt (and one gcd prompt, whose samples must not count) with these outcomes."""
    from postrl.controller.stages.base import Groups
    from postrl.types import RewardResult, Rollout

    chain = next(p for p in draw.next_prompts(8) if p.task_type == "chain_sum")
    gcd = next(p for p in draw.next_prompts(8) if p.task_type == "gcd")
    rollouts = [Rollout(0, [], [], [], "", "stop", 0) for _ in outcomes] + [Rollout(1, [], [], [], "", "stop", 0)]
    rewards = [RewardResult(float(ok), {"correct": float(ok)}) for ok in outcomes] + [
        RewardResult(1.0, {"correct": 1.0})
    ]
    return Groups([chain, gcd], rollouts, rewards)


def test_the_curriculum_raises_and_lowers_a_level_on_a_scripted_accuracy_sequence(char_tokenizer):
    stage, draw = curriculum_stage(char_tokenizer)
    levels = []
    script = [[True, True], [True, True], [True, True, False, True], [False] * 4, [False, True, False, False],
              [False, False, False, True], [True, False]]  # fmt: skip
    for outcomes in script:
        _, metrics = stage.select(scripted_groups(draw, outcomes))
        levels.append(metrics["curriculum/chain_sum/level"])
    # window 4: [T,T] not full; [T,T,T,T] 1.0 >= 0.75 -> level 2, window emptied; [T,T,F,T] 0.75 -> 3;
    # [F]*4 0.0 <= 0.25 -> 2; [F,T,F,F] 0.25 -> 1; [F,F,F,T] -> 0; [T,F] not full: stays 0
    assert levels == [1.0, 2.0, 3.0, 2.0, 1.0, 0.0, 0.0]
    assert "curriculum/gcd/level" not in metrics  # a task without a level does not move


def test_the_curriculum_draws_prompts_at_the_current_level(char_tokenizer):
    stage, draw = curriculum_stage(char_tokenizer, level=0)
    low = {p.columns["rg_config"]["max_terms"] for p in draw.next_prompts(20) if p.task_type == "chain_sum"}
    draw.set_level("chain_sum", 3)
    high = {p.columns["rg_config"]["max_terms"] for p in draw.next_prompts(20) if p.task_type == "chain_sum"}
    assert low == {2} and high == {5}  # reasoning-gym's chain_sum curriculum: 2 + level terms at most


def test_the_curriculum_and_its_draw_resume_at_the_same_levels_and_prompts(char_tokenizer):
    stage, draw = curriculum_stage(char_tokenizer)
    stage.select(scripted_groups(draw, [True] * 4))
    stage.select(scripted_groups(draw, [True, True]))
    saved_stage, saved_draw = stage.state_dict(), draw.state_dict()
    expected = [p.text for p in draw.next_prompts(12)]
    fresh_stage, fresh_draw = curriculum_stage(char_tokenizer)
    fresh_draw.load_state_dict(saved_draw)
    fresh_stage.load_state_dict(saved_stage)
    assert fresh_draw.levels["chain_sum"] == 2 and list(fresh_stage.windows["chain_sum"]) == [True, True]
    assert [p.text for p in fresh_draw.next_prompts(12)] == expected
    _, metrics = fresh_stage.select(scripted_groups(fresh_draw, [True, True]))  # completes the resumed window
    assert metrics["curriculum/chain_sum/level"] == 3.0


def test_without_reasoning_gym_the_config_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # an import of it now fails, as when not installed
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    with pytest.raises(ValueError, match=r"pip install 'postrl\[gym\]'"):
        RunConfig.model_validate({"data": {"reasoning_gym": {"tasks": [{"name": "gcd"}]}}})


def test_chat_rows_for_a_tokenizer_without_a_chat_template_name_the_setting():
    from postrl.tasks.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None  # like the GGUF of Gemma 3 270M, a base model
    with pytest.raises(DatasetError, match="no chat template .*data.reasoning_gym.chat_template: false"):
        build_gym_prompts(gym(), tokenizer, 0, 4, 512)
