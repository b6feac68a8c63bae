"""Multi-turn episodes: chat-template deltas and the template checker on four families, tools
(parsing, errors, time limits), the episode runner's token-exact trajectories, loss masks, limits
and prefix-break policies, and an ``agent:`` run end to end on the native engine."""

from __future__ import annotations

import re
import time

import pytest
import torch

from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.rollout.agentic.builtin_tools import calculator
from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.env import StepResult, ToolEnvironment
from postrl.rollout.agentic.env_lookup import environment_factory
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner, episode_metrics
from postrl.rollout.agentic.template_check import check_template
from postrl.rollout.agentic.tools import Tool, ToolBox, parse_tool_calls
from postrl.types import Prompt, Rollout, SamplingParams
from tests.chat_templates import TEMPLATES, family_tokenizer

SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=32)


@pytest.mark.parametrize(
    ("family", "broken"),
    [("smollm2", []), ("qwen2.5", []), ("qwen3", ["reasoning"]), ("llama3", ["whitespace"])],
)
def test_the_checker_flags_exactly_the_templates_that_rewrite_history(family, broken):
    report = check_template(family_tokenizer(family))
    assert report.broken() == broken
    assert report.append_only == (not broken)
    for case in report.cases:
        if case.name in broken:
            assert case.turn == 1 and "re-rendered" in case.detail


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_the_delta_of_new_messages_is_what_full_rendering_adds(family):
    """context + delta == the full rendering, as text and as tokens, for a tool conversation."""
    tok = family_tokenizer(family)
    renderer = ChatRenderer(tok)
    messages = [{"role": "user", "content": "What is 12*34?"}]
    seen = renderer.render(messages, generation_prompt=True)
    ids = renderer.encode(seen)
    model_turn = renderer.encode('calculator(expression="12*34")') + renderer.end_of_turn_ids()
    ids += model_turn
    seen += renderer.decode(model_turn)
    messages += [{"role": "assistant", "content": 'calculator(expression="12*34")'}, {"role": "tool", "content": "408"}]
    delta, full = renderer.delta(seen, messages)
    assert delta.ok and seen + delta.text == full
    assert renderer.decode(ids + delta.ids) == full


def test_engine_tokens_that_do_not_survive_decode_and_encode_are_kept_exactly():
    """A model turn whose tokens re-encode differently (here <answer> spelled out letter by letter
    instead of the one added token) stays the engine's tokens in the trajectory."""
    tok = family_tokenizer("smollm2")
    spelled = [tok.convert_tokens_to_ids(c) for c in "<answer>"] + tok.encode("7", add_special_tokens=False)
    assert tok.encode(tok.decode(spelled), add_special_tokens=False) != spelled
    turns = [spelled + [tok.convert_tokens_to_ids("<|im_end|>")]]
    rollouts = run_script(tok, turns, env=lambda **_: ScriptedEnv(["more?"]), n=1, limits=EpisodeLimits(max_turns=1))
    assert rollouts[0].response_ids[: len(spelled)] == spelled


def test_tool_calls_are_parsed_in_hermes_and_plain_form_and_bad_ones_are_answered_not_raised():
    hermes = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(hermes, {"calculator"})] == [
        ("calculator", {"expression": "2*3"})
    ]
    plain = 'I will compute.\ncalculator(expression="2*3")'
    assert [(c.name, c.arguments) for c in parse_tool_calls(plain, {"calculator"})] == [
        ("calculator", {"expression": "2*3"})
    ]
    assert parse_tool_calls("print(x=1)", {"calculator"}) == []  # not a known tool: plain text

    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "done"

    box = ToolBox([Tool.from_function(calculator), Tool.from_function(slow)], timeout_s=0.2)
    cases = {
        "<tool_call>{not json}</tool_call>": "malformed tool call: not JSON",
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': "unknown tool 'search'",
        '<tool_call>{"name": "slow", "arguments": {"seconds": 2}}</tool_call>': "timed out after 0.2 s",
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>': "bad arguments for 'calculator'",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}</tool_call>': "larger than 100",
        "<tool_call>{": "without </tool_call>",
    }
    for text, expected in cases.items():
        (call,) = box.parse(text)
        answer, record = box.call(call)
        assert answer.startswith("error: ") and expected in answer and record.error is not None, text
    (call,) = box.parse(hermes)
    assert box.call(call)[0] == "6"
    box.close()


def test_a_tool_schema_comes_from_type_hints_and_the_docstring():
    schema = Tool.from_function(calculator).schema["function"]
    assert schema["name"] == "calculator" and schema["description"].startswith("Evaluate an arithmetic")
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert "e.g." in schema["parameters"]["properties"]["expression"]["description"]
    with pytest.raises(ValueError, match="needs a type hint"):
        Tool.from_function(lambda x: x)


class ScriptedEnv:
    """Answers every turn with the next of ``replies`` (a user message), done after the last."""

    tools: list[Tool] = []

    def __init__(self, replies: list[str], reward: float = 1.0) -> None:
        self.replies, self.reward = list(replies), reward

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> StepResult:
        if not self.replies:
            return StepResult([], reward=self.reward, done=True)
        return StepResult([{"role": "user", "content": self.replies.pop(0)}])

    def close(self) -> None:
        pass


def run_script(
    tok,
    turns: list[list[int]],
    env,
    n: int = 2,
    limits=EpisodeLimits(),
    policy="split",
    row: dict | None = None,
    tools_in_prompt="template",
) -> list[Rollout]:
    """Episodes whose model turns are ``turns`` (the same for every episode), through the runner
    with a scripted engine that checks the prompts it is given."""
    calls = []

    def generate(prompts: list[Prompt], sp: SamplingParams) -> list[Rollout]:
        turn = turns[min(len(calls), len(turns) - 1)]
        calls.append(prompts)
        out = []
        for i, p in enumerate(prompts):
            ids = turn[: sp.max_tokens]
            finish = "length" if len(turn) > sp.max_tokens else "stop"
            out.append(Rollout(i, list(p.prompt_ids), ids, [-0.5] * len(ids), tok.decode(ids), finish, 3))
        return out

    runner = EpisodeRunner(generate, env, tok, limits, policy, tools_in_prompt=tools_in_prompt)
    try:
        return runner.run([Prompt("Hi", [], columns=row or {}, messages=None)], SamplingParams(n=n, max_tokens=64))
    finally:
        runner.close()


def test_trajectories_are_the_engine_tokens_with_the_loss_mask_on_the_model_turns_only():
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok.encode("one", add_special_tokens=False) + [end], tok.encode("two", add_special_tokens=False) + [end]]
    rollouts = run_script(tok, turns, env=lambda **_: ScriptedEnv(["again"]))
    assert len(rollouts) == 2
    r = rollouts[0]
    renderer = ChatRenderer(tok)
    first = renderer.render([{"role": "user", "content": "Hi"}], generation_prompt=True)
    assert r.prompt_ids == renderer.encode(first)
    delta = renderer.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert r.response_ids == turns[0] + delta + turns[1]
    assert r.loss_mask == [1] * 4 + [0] * len(delta) + [1] * 4
    assert r.logprobs == [-0.5] * 4 + [0.0] * len(delta) + [-0.5] * 4
    assert r.episode.reward == 1.0 and r.episode.finish_reason == "stop" and len(r.episode.turns) == 2
    # the whole conversation as the template renders it, but for the "\n" it puts after a model's last turn
    assert tok.decode(r.prompt_ids + r.response_ids) + "\n" == renderer.render(
        r.episode.messages, generation_prompt=False
    )


@pytest.mark.parametrize(
    ("limits", "finish", "turns"),
    [
        (EpisodeLimits(max_turns=2), "max_turns", 2),
        (EpisodeLimits(max_tokens_per_turn=3), "length", 1),
        (EpisodeLimits(max_turns=3, max_tokens_per_turn=3, end_on_turn_length=False), "max_turns", 3),
        (EpisodeLimits(max_context=50), "max_context", 2),  # 21 + 5 + 21 tokens leave 3 for turn 2
    ],
)
def test_an_episode_at_each_limit_ends_with_that_reason(limits, finish, turns):
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rollouts = run_script(
        tok, [tok.encode("abcd", add_special_tokens=False) + [end]], lambda **_: ScriptedEnv(["x"] * 9), 1, limits
    )
    (r,) = rollouts
    assert r.finish_reason == finish and r.episode.finish_reason == finish and len(r.episode.turns) == turns
    assert len(r.prompt_ids) + len(r.response_ids) <= limits.max_context
    assert r.loss_mask[-1] == 1  # no observation tokens trail the last model turn


def test_a_prefix_break_is_split_or_kept_and_counted_never_retokenized():
    """Qwen3 drops an earlier turn's <think> block once a new user message comes."""
    tok = family_tokenizer("qwen3")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    thinking = tok.encode("<think>\nhm\n</think>\n\nA", add_special_tokens=False) + [end]
    answer = tok.encode("B", add_special_tokens=False) + [end]
    split = run_script(tok, [thinking, answer], lambda **_: ScriptedEnv(["next"]), 1, policy="split")
    assert len(split) == 2 and split[0].episode.prefix_breaks == 1
    assert split[0].response_ids == thinking and split[0].loss_mask == [1] * len(thinking)
    renderer = ChatRenderer(tok)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA"},
        {"role": "user", "content": "next"},
    ]
    assert split[1].prompt_ids == renderer.encode(
        renderer.render(history, generation_prompt=True)
    )  # the template's rendering
    assert split[1].response_ids == answer and split[1].episode.part == 1
    kept = run_script(tok, [thinking, answer], lambda **_: ScriptedEnv(["next"]), 1, policy="keep_context")
    assert len(kept) == 1 and kept[0].episode.prefix_breaks == 1
    assert kept[0].response_ids[: len(thinking)] == thinking  # the model's own tokens stay the context
    assert kept[0].response_ids[-len(answer) :] == answer
    metrics = episode_metrics(split)
    assert metrics["agent/prefix_breaks"] == 1 and metrics["agent/samples_per_episode"] == 2


def test_a_first_prompt_that_fills_the_context_is_refused_by_name():
    tok = family_tokenizer("smollm2")  # its default system prompt alone is 80 tokens
    with pytest.raises(ValueError, match="agent.max_context=40"):
        run_script(tok, [[1]], lambda **_: ScriptedEnv([]), 1, EpisodeLimits(max_context=40))


def test_environments_are_found_by_name_or_import_path():
    assert environment_factory("calculator")().tools[0].name == "calculator"
    assert environment_factory("tests.test_agentic:ScriptedEnv") is ScriptedEnv
    with pytest.raises(ValueError, match="unknown environment 'maze'"):
        environment_factory("maze")
    with pytest.raises(ValueError, match="no module named 'tests.nothing_here'"):
        environment_factory("tests.nothing_here:Maze")
    with pytest.raises(ValueError, match="has no 'Maze'; it has: ScriptedEnv"):
        environment_factory("tests.test_agentic:Maze")


def test_the_calculator_environment_rewards_the_right_answer_after_a_tool_call():
    env = ToolEnvironment(["calculator"])
    assert env.reset({"prompt": "12*34", "answer": "408", "messages": None}) == [{"role": "user", "content": "12*34"}]
    result = env.step('calculator(expression="12*34")')
    assert result.messages == [{"role": "tool", "name": "calculator", "content": "408"}] and not result.done
    assert env.step("<answer>408</answer>").reward == 1.0
    assert env.step("<answer>407</answer>").reward == 0.0
    env.close()


def test_a_multi_turn_step_trains_and_credits_only_the_model_tokens():
    """StepBatch from an episode's rollout: the loss mask and the token-level advantages (GAE over
    the critic's values) skip the tool's tokens; their values never enter."""
    import torch

    from postrl.config.algorithm import AlgorithmConfig
    from postrl.controller.advantage import compute_advantage
    from postrl.types import RewardResult, StepBatch

    mask = [1, 1, 0, 0, 1]
    rollout = Rollout(0, [7, 8], [1, 2, 3, 4, 5], [-0.1, -0.2, 0.0, 0.0, -0.3], "", "stop", 0, loss_mask=mask)
    step = StepBatch.build([Prompt("p", [7, 8])], [rollout], [RewardResult(1.0)], pad_id=0)
    span = step.spans[0]
    assert step.batch.loss_mask[0, span].tolist() == mask and step.batch.response_mask[0, span].tolist() == [1] * 5
    values = torch.zeros_like(step.batch.loss_mask)
    values[0, span] = torch.tensor([0.5, 0.4, 77.0, -77.0, 0.2])
    step.batch.values = values
    gae = {"type": "gae", "gamma": 1.0, "lam": 1.0, "whiten": False}
    compute_advantage(step, AlgorithmConfig.model_validate({"advantage": gae, "critic": {"lr": 1e-4}}))
    # lambda = gamma = 1: each model token's advantage is the return (1) minus its value
    assert step.batch.advantages[0, span].tolist() == pytest.approx([0.5, 0.6, 0.0, 0.0, 0.8])
    assert step.experiences()[0].loss_mask == mask


def test_a_multi_turn_task_without_an_agent_is_refused_naming_the_environment():
    from postrl.config.run import RunConfig

    with pytest.raises(ValueError, match="data.task=calculator is a multi-turn task: set agent.env=calculator"):
        RunConfig.model_validate({"data": {"task": "calculator"}})
    assert (
        RunConfig.model_validate({"data": {"task": "calculator"}, "agent": {"env": "calculator"}}).agent.env
        == "calculator"
    )


def test_the_shipped_agentic_warm_start_calls_its_tool_or_answers():
    """``agentic-demo`` (scripts/build_agentic_model.py, shipped): greedy on 24 of its training
    products it calls ``calculator(expression="a*b")`` on some (6 on the CPU it was built on) and
    answers ``<answer>N</answer>`` on the others; the demo model it started from never calls it."""
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.tasks.calculator_task import problems

    def first_turns(name: str) -> list[tuple[tuple[int, int], str]]:
        tokenizer = load_tokenizer(name)
        renderer = ChatRenderer(tokenizer)
        engine = NativeRolloutWorker.from_hf(load_causal_lm(name), tokenizer, torch.float32)
        pairs = problems(seed=0)[0][:24]
        prompts = [
            Prompt("", renderer.encode(renderer.render([{"role": "user", "content": f"{a}*{b}"}], True)))
            for a, b in pairs
        ]
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=40, stop_token_ids=tuple(renderer.end_of_turn_ids()))
        return [
            (pair, r.text.removesuffix("<|im_end|>")) for pair, r in zip(pairs, engine.generate(prompts, greedy, None))
        ]

    turns = first_turns("agentic-demo")
    calls = [(a, b) for (a, b), text in turns if text == f'calculator(expression="{a}*{b}")']
    answers = [text for _, text in turns if re.fullmatch(r"<answer>\d+</answer>", text)]
    assert 3 <= len(calls) <= 12 and len(calls) + len(answers) == 24
    assert not any(text.startswith("calculator(") for _, text in first_turns("demo"))
