"""Issue 58: what a user's fifth day found, each as a test that fails without its fix: progress during
long phases, the messages that misled, the fresh-folder data step and the smaller things. The
distillation figures on the demo are a benchmark (``benchmarks/distill.py --demo``), not a test."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from postrl.cli import main
from postrl.run import progress as console_progress
from postrl.run.progress import ConsoleProgress
from postrl.types import StepMetrics
from postrl.types.progress import Phase, install, phase
from tests.conftest import make_tiny_model
from tests.test_distill import distill_run
from tests.test_third_day import REPO, agent_run


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- progress ---------------------------------------------------------------------------------------
def test_a_long_phase_shows_done_total_tokens_per_second_and_time_left_as_a_few_plain_lines():
    clock, shown = FakeClock(), []
    reporter = ConsoleProgress(shown.append, lines=True, after_s=5, every_s=30, clock=clock, ticking=False)
    install(reporter)
    try:
        with phase("episodes", 16, "episodes") as episodes:
            clock.now += 4
            episodes.advance(2, 400)
            reporter.tick()
            assert shown == []  # shorter than 5 s so far: nothing
            clock.now += 6  # 10 s in: 4 of 16 done, 1000 tokens
            episodes.advance(2, 600)
            reporter.tick()
            clock.now += 10  # not due again before 30 s more
            reporter.tick()
            clock.now += 20
            episodes.advance(12, 2000)
            reporter.tick()
    finally:
        install(None)
    assert shown == [
        "episodes: 4/16 episodes (25%), 100 tok/s, 10s elapsed, ~30s left",
        "episodes: 16/16 episodes (100%), 75 tok/s, 40s elapsed",
        "episodes: 16/16 episodes in 40s, 75 tok/s",  # the phase's end, once it was shown
    ]


def test_on_a_terminal_the_phases_ride_on_one_line_that_is_cleared_at_their_end():
    clock, shown = FakeClock(), []
    reporter = ConsoleProgress(shown.append, lines=False, after_s=2, clock=clock, ticking=False)
    install(reporter)
    try:
        with phase("generate", 256, "samples") as generate:
            clock.now += 1
            with phase("teacher math", 64, "samples"):
                reporter.tick()
                assert shown == []
                clock.now += 2
                generate.advance(64, 1024)
                reporter.tick()  # the teacher's pass is 2 s old, generation 3 s: both shown
        reporter.tick()
    finally:
        install(None)
    assert shown[0] == (
        "generate [##........] 64/256 samples (25%), 341 tok/s, 3s elapsed, ~9s left · "
        "teacher math [..........] 0/64 samples (0%), 2s elapsed"
    )
    assert shown[-1] == ""  # no phase is left: the bar's text is cleared


def test_a_short_phase_shows_nothing_and_no_reporter_costs_nothing():
    shown: list[str] = []
    reporter = ConsoleProgress(shown.append, lines=True, clock=FakeClock(), ticking=False)
    install(reporter)
    try:
        with phase("update", 8, "samples") as update:
            update.advance(8, 100)
            reporter.tick()
    finally:
        install(None)
    assert shown == []
    with phase("update", 8, "samples") as alone:  # no reporter installed: the phase still counts
        alone.advance(3)
    assert isinstance(alone, Phase) and alone.snapshot() == (3, 0)


def test_a_long_step_of_agent_episodes_prints_its_progress(tmp_path, capsys, monkeypatch):
    """An agent function that thinks 250 ms per episode, one at a time: the batch's 8 episodes take
    about 2 s; shown after 0.3 s and every 0.5 s (5 s and 30 s in a real run), as plain lines on
    stderr (not a terminal), ending with the phase's summary."""
    monkeypatch.setattr(console_progress, "AFTER_S", 0.3)
    monkeypatch.setattr(console_progress, "EVERY_S", 0.5)
    monkeypatch.setattr(console_progress, "TICK_S", 0.05)
    thinks = "agent.function=tests.fault_envs:agent_thinks_a_while"
    args = agent_run(tmp_path, "agent.env=null", thinks, "agent.env_workers=1")
    assert main(args) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("episodes: ")]
    assert 2 <= len(lines) <= 20, err  # a line per 0.5 s and one at the end, not one per tick (every 0.05 s)
    assert any(" episodes (" in line and "elapsed, ~" in line and "left" in line for line in lines[:-1]), lines
    assert lines[-1].startswith("episodes: 8/8 episodes in ") and "tok/s" in lines[-1]


def test_the_native_engine_s_samples_and_tokens_are_counted_through_the_pool(tiny_model_dir, char_tokenizer):
    from postrl.config.run import RolloutConfig
    from postrl.controller.source import SingleTurn
    from postrl.models.loading import load_causal_lm
    from postrl.rollout.factory import rollout_worker_for_model
    from postrl.rollout.pool import RolloutPool
    from postrl.rollout.weight_transport import DirectTransport
    from postrl.types import Prompt, SamplingParams
    from postrl.workers.handles import InProcessHandle

    model = load_causal_lm(str(tiny_model_dir))
    engine = rollout_worker_for_model(RolloutConfig(), model, char_tokenizer, "float32", seed=0)
    pool = RolloutPool(lambda i: InProcessHandle(engine, f"engine {i}", serialized=False), 1, DirectTransport())
    seen: list[Phase] = []

    class Keep:
        def opened(self, p: Phase) -> None:
            seen.append(p)

        def closed(self, p: Phase) -> None:
            pass

    install(Keep())
    try:
        prompts = [Prompt(t, char_tokenizer(t)["input_ids"]) for t in ("1+2=", "33+4=", "5+66=")]
        rollouts = SingleTurn(pool, None).generate(prompts, SamplingParams(n=2, max_tokens=5), None)  # type: ignore[arg-type]
    finally:
        install(None)
        engine.close()
    (generated,) = seen
    assert (generated.name, generated.total, generated.unit) == ("generate", 6, "samples")
    assert generated.snapshot() == (6, sum(len(r.response_ids) for r in rollouts))


class KeptPhases:
    """A reporter that keeps every phase opened (to read their counts after they close)."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []

    def opened(self, p: Phase) -> None:
        self.phases.append(p)

    def closed(self, p: Phase) -> None:
        pass


def test_a_teacher_s_pass_is_asked_in_parts_each_shown_as_it_returns():
    from postrl.config.distill import DistillConfig
    from postrl.train.teachers.teachers import TeacherSet
    from postrl.types.teaching import TeacherQuery

    class Scores:
        source = "fake"

        def __init__(self) -> None:
            self.calls: list[int] = []

        def logprobs(self, queries):
            self.calls.append(len(queries))
            return [[-1.0] * (len(q.ids) - q.start) for q in queries]

    scores, kept = Scores(), KeptPhases()
    teachers = TeacherSet(DistillConfig.model_validate({"teacher": "fake"}), [scores])  # type: ignore[list-item]
    queries = [TeacherQuery([1, 2, 3, i + 4], 2) for i in range(130)]  # 130 distinct samples of 2 tokens
    install(kept)
    try:
        answers, counts = teachers.logprobs([0] * 130, queries)
    finally:
        install(None)
    assert scores.calls == [64, 64, 2] and len(answers) == 130 and counts.asked == {"teacher": 130}
    (shown,) = kept.phases
    assert (shown.name, shown.total, shown.unit, shown.snapshot()) == ("teacher", 130, "samples", (130, 260))


def test_a_demo_step_s_generation_and_update_are_phases_counted_to_their_totals(tmp_path):
    kept = KeptPhases()
    install(kept)  # logging.progress false: the run installs no console reporter of its own
    try:
        args = ["demo", f"output_dir={tmp_path}", "steps=1", "prompts_per_step=2", "logging.progress=false"]
        assert main([*args, "train.epochs=2"]) == 0
    finally:
        install(None)
    named = [(p.name, p.total, p.snapshot()[0]) for p in kept.phases]
    # the held-out evaluation before and after (200 prompts, greedy); the step's 2 x 8 samples, updated twice
    assert named == [("generate", 200, 200), ("generate", 16, 16), ("update", 32, 32), ("generate", 200, 200)]
    assert kept.phases[1].snapshot()[1] > 16  # the step's generated tokens, counted as sampled


# -- messages that misled ---------------------------------------------------------------------------
@pytest.mark.parametrize("task_reward", [True, False])
def test_a_distillation_run_does_not_say_identical_rewards_give_no_gradient(
    tmp_path, tiny_model_dir, char_tokenizer, arithmetic_jsonl, capsys, task_reward
):
    """A reward that is always 5: every group's rewards are identical, yet the teacher's term gives
    every token a gradient. The console shows the reverse KL and says what teaches those groups."""
    from postrl.config.loading import build_config
    from postrl.run.watch import run_watches

    teacher = tmp_path / "teacher"
    make_tiny_model("llama", char_tokenizer, seed=1).save_pretrained(teacher)
    char_tokenizer.save_pretrained(teacher)
    distill = {"teacher": str(teacher), "task_reward": task_reward}
    name = f"constant-{task_reward}"
    _, rows, _ = distill_run(tmp_path, tiny_model_dir, arithmetic_jsonl, distill, name, steps=3, reward="returns_five")
    out, err = capsys.readouterr()
    assert all(row["reward/no_signal_groups"] == 1.0 for row in rows)
    assert all(row["actor/grad_norm"] > 0 for row in rows)  # the teacher's term gives every step a gradient
    assert "no advantage, no gradient" not in out and "nothing was learned" not in err
    assert out.count("distill kl ") == 3
    assert ("100% of groups have identical rewards (their gradient is the teacher's term alone)" in out) is task_reward
    config = build_config({"model": {"path": "demo"}, "algorithm": {"distill": distill}})
    assert not any(type(w).__name__ == "NoSignalWatch" for w in run_watches(config, print))


def test_each_policy_s_tokens_per_second_are_over_the_generation_they_share():
    from postrl.run.policies_runner import shared_generation_rates

    stepped = {  # the first policy ran the batch (2 s); the second took its part of it in 1 ms
        "alice": StepMetrics(1, 1, {"perf/gen_tokens_per_s": 1000.0, "time/generate_s": 2.0}),
        "bob": StepMetrics(1, 1, {"perf/gen_tokens_per_s": 1_411_324.0, "time/generate_s": 0.001}),
    }
    assert shared_generation_rates(stepped) == pytest.approx({"alice": 1000.0, "bob": 705.662})


def test_a_two_policy_run_s_console_shows_rates_that_add_up(tmp_path, arithmetic_jsonl, capsys):
    from tests.test_policies import train_args

    assert main(train_args(tmp_path, arithmetic_jsonl, "steps=1")) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "runs" / "two" / "metrics.jsonl").read_text().splitlines()]
    seconds = max(row["proposer/time/generate_s"], row["solver/time/generate_s"])
    for name in ("proposer", "solver"):
        tokens = row[f"{name}/response/length_mean"] * row[f"{name}/reward/samples"]
        assert row[f"{name}/perf/gen_tokens_per_s"] * seconds == pytest.approx(tokens)


def test_eval_of_a_model_folder_takes_the_demo_task_with_or_without_samples(capsys):
    assert main(["eval", "--model", "demo", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("arithmetic: held-out accuracy ")
    assert main(["eval", "--model", "demo", "--n", "2", "--max-tokens", "4", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(figures["sets"]) == ["arithmetic"] and figures["sets"]["arithmetic"]["prompts"] == 200


def test_maj_at_k_that_cannot_be_counted_is_explained_under_the_table():
    from postrl.run.harness import NO_VOTES, Figures, SetReport, table

    figures = Figures(prompts=2, greedy=0.5, mean_at_n=0.5, pass_at={1: 0.5, 2: 1.0}, maj_at={})
    report = SetReport("held_out.jsonl", figures, {})
    with_votes, without = table([report], [1, 2], 2), table([report], [1, 2], 2, votes=False)
    assert "n/a" in without and without.splitlines()[-1] == NO_VOTES
    assert "maj@k is n/a: the episodes' rewards come from their environment or agent function" in NO_VOTES
    assert NO_VOTES not in with_votes and NO_VOTES not in table([report], [], 0, votes=False)


def test_a_failure_inside_an_installed_library_names_the_user_s_line(tmp_path, monkeypatch):
    """The agent's call into a library (here a package under a site-packages folder, as the openai
    client is) raises inside it: the reason names the agent's own line."""
    from postrl.rollout.agentic.limited import describe_failure

    library = tmp_path / "lib" / "python3.11" / "site-packages" / "fakeclient"
    library.mkdir(parents=True)
    (library / "__init__.py").write_text("def post(body):\n    raise ConnectionError('the server hung up')\n")
    agent = tmp_path / "my_agent.py"
    agent.write_text("import fakeclient\n\n\ndef run(row):\n    return fakeclient.post(row)\n")
    monkeypatch.syspath_prepend(str(library.parent))
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_agent

    try:
        my_agent.run({})
    except ConnectionError as exc:
        reason, text = describe_failure(exc)
    assert "fakeclient/__init__.py" in text  # the innermost frame, in the whole traceback
    assert reason == f"ConnectionError: the server hung up ({agent}:5)"


def test_a_failure_wholly_inside_a_library_names_its_innermost_frame(tmp_path, monkeypatch):
    from postrl.rollout.agentic.limited import describe_failure

    library = tmp_path / "site-packages" / "onlylib"
    library.mkdir(parents=True)
    # the error is raised and caught in the library (as in a library's own thread): no frame of the user's
    (library / "__init__.py").write_text(
        "def fail():\n    try:\n        raise KeyError('k')\n    except KeyError as e:\n        return e\n"
    )
    monkeypatch.syspath_prepend(str(library.parent))
    import onlylib

    reason, _ = describe_failure(onlylib.fail())
    assert reason == f"KeyError: 'k' ({library / '__init__.py'}:3)"


def test_an_error_without_a_message_goes_on_with_the_reason_of_the_error_it_was_raised_from(tmp_path, monkeypatch):
    """verifiers wraps the client's refusal in a bare ModelError: the reason carries the refusal's
    message, which says what to change; an error with a message of its own keeps it alone."""
    from postrl.rollout.agentic.limited import describe_failure

    library = tmp_path / "site-packages" / "wrapping"
    library.mkdir(parents=True)
    (library / "__init__.py").write_text(
        "class ModelError(Exception):\n    pass\n\n\n"
        "def call(message):\n    try:\n        raise ValueError('400: set tools_in_prompt')\n"
        "    except ValueError as e:\n        raise (ModelError(message) if message else ModelError()) from e\n"
    )
    agent = tmp_path / "wrapped_agent.py"
    agent.write_text("import wrapping\n\n\ndef run(message):\n    return wrapping.call(message)\n")
    monkeypatch.syspath_prepend(str(library.parent))
    monkeypatch.syspath_prepend(str(tmp_path))
    import wrapped_agent
    import wrapping

    reasons = []
    for message in ("", "the model failed"):
        try:
            wrapped_agent.run(message)
        except wrapping.ModelError as exc:
            reasons.append(describe_failure(exc)[0])
    lib = library / "__init__.py"
    assert reasons == [
        f"ModelError ({agent}:5) from ValueError: 400: set tools_in_prompt ({lib}:7)",
        f"ModelError: the model failed ({agent}:5)",
    ]


def test_a_run_without_tools_is_not_told_that_the_template_drops_them(caplog):
    """SmolLM2's template drops tools=; an agent function run offers none at its start (a call with
    tools= is refused at that call, naming agent.tools_in_prompt), so its start says nothing of it."""
    from postrl.rollout.agentic.template_check import TOOLS_DROPPED, check_template
    from tests.chat_templates import family_tokenizer

    report = check_template(family_tokenizer("smollm2"))
    assert not report.tools_rendered
    assert TOOLS_DROPPED not in report.summary("keep", tools_shown=False)
    assert TOOLS_DROPPED in report.summary("keep")  # postrl check-template, and a run whose tools go through it


@pytest.mark.parametrize(
    ("kind", "logger"),
    [
        ("agent.function=tests.fault_envs:agent_answers", "function_episodes"),
        ("agent.env=tests.fault_envs:GuessNumber", "env_episodes"),
    ],
)
def test_an_agent_run_without_tools_on_a_template_that_drops_them_says_nothing_of_tools(tmp_path, capsys, kind, logger):
    """The demo model's template drops tools=; neither an agent function nor an environment without
    tools offers any, so the run's report of its template says nothing of them."""
    args = agent_run(tmp_path, "agent.env=null", kind) if "function" in kind else agent_run(tmp_path, kind)
    assert main(["-v", *args]) == 0  # -v: postrl's INFO lines, where the template's report is
    err = capsys.readouterr().err
    (report,) = [line for line in err.splitlines() if line.startswith(f"INFO postrl.controller.{logger}: agent:")]
    assert "the chat template is append-only" in report and "tools" not in report


def test_an_episode_id_used_again_for_a_new_conversation_is_warned_about_once(caplog):
    import httpx
    import openai

    from postrl.rollout.agentic.recorder import EpisodeRecorder
    from postrl.serve.batcher import EngineBatcher
    from postrl.serve.limits import ServerLimits
    from postrl.serve.openai_server import build_app
    from tests.chat_templates import family_tokenizer
    from tests.scripted_engine import ScriptedEngine
    from tests.test_serve import Server

    tokenizer = family_tokenizer("qwen2.5")
    engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    batcher = EngineBatcher(engine)
    recorder = EpisodeRecorder(tokenizer, ids_from_callers=True)
    server = Server(build_app(batcher, tokenizer, "m", limits=ServerLimits(default_max_tokens=16), recorder=recorder))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/episodes/e1/v1", api_key="x", max_retries=0)
        engine.script = ["4", "5", "4", "4"]
        ask = [{"role": "user", "content": "2+2?"}]
        with caplog.at_level(logging.WARNING, logger="postrl.rollout.agentic.recorder"):
            first = client.chat.completions.create(model="m", messages=ask)
            more = [
                *ask,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "+1?"},
            ]
            client.chat.completions.create(model="m", messages=more)  # the same conversation: no warning
            assert not caplog.records
            client.chat.completions.create(model="m", messages=ask)  # a new run of the agent, the same id
            client.chat.completions.create(model="m", messages=ask)  # warned once per id
        (warning,) = caplog.records
        assert warning.getMessage().startswith(
            "episode e1 already holds a recording of 2 model calls, and this call starts a new conversation in it"
        )
        assert "DELETE /v1/episodes/e1" in warning.getMessage()
        assert httpx.get(f"{server.url}/v1/episodes/e1").json()["prefix_breaks"] == 2
    finally:
        server.stop()
        batcher.close()


def test_a_run_s_own_episode_ids_are_never_warned_about(caplog):
    from postrl.rollout.agentic.recorder import EpisodeRecorder
    from tests.chat_templates import family_tokenizer

    assert EpisodeRecorder(family_tokenizer("qwen2.5")).ids_from_callers is False


# -- the data step of examples/smollm2_grpo.yaml, in a fresh folder -----------------------------------
def test_the_documented_data_step_works_in_a_fresh_folder(tmp_path):
    header = (REPO / "examples" / "smollm2_grpo.yaml").read_text().splitlines()
    (step,) = [line for line in header if "write_jsonl(" in line]
    code = step.split('python -c "', 1)[1].rsplit('"', 1)[0]
    assert "'runs/addition.jsonl'" in code
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = (tmp_path / "runs" / "addition.jsonl").read_text().splitlines()
    assert len(rows) == 2000 and json.loads(rows[0])["task_type"] == "chat_addition"


# -- smaller --------------------------------------------------------------------------------------
def test_a_trained_model_s_card_says_how_it_was_prompted(tmp_path, capsys):
    from transformers import AutoTokenizer

    assert main(["demo", f"output_dir={tmp_path}", "steps=1", "prompts_per_step=2", "logging.progress_bar=false"]) == 0
    folder = tmp_path / "demo" / "final_model"
    card = (folder / "README.md").read_text()
    assert "Trained by postrl from `demo`: `postrl train`, 1 step of grpo advantages with the ppo_clip loss" in card
    assert "tokenized as they are (`tokenizer(prompt)`, no chat template)" in card
    assert "The tokenizer's chat template was not used for them" in card
    assert "For example (task `arithmetic`): the prompt `964+494=`, whose expected answer is `1458`." in card
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "964+494="}], add_generation_prompt=True, tokenize=False
    )
    assert chat != "964+494="  # why the card is needed: the template's prompt is not the trained one


def test_exact_mode_is_named_at_the_start_and_its_difference_shown_every_step(tmp_path, capsys):
    from postrl.run.metrics import console_line
    from postrl.run.watch import EXACT_MODE

    metrics = StepMetrics(1, 1, {"reward/mean": 0.5, "rollout/logprob_diff_max": 0.0, "time/step_s": 0.4})
    assert console_line(metrics, 2, exact=True) == "step 1/2 | reward 0.500 | engine-trainer diff 0 | s 0.4"
    assert "engine-trainer diff" not in console_line(metrics, 2)
    args = ["demo", f"output_dir={tmp_path}", "steps=1", "prompts_per_step=2", "logging.progress_bar=false"]
    args += ["rollout.exact=true", "rollout.dtype=float32", "train.precision=float32"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert EXACT_MODE in out + err
    assert "| engine-trainer diff 0 |" in out
