"""On-policy distillation (``algorithm.distill``): the reverse-KL term by hand, its config, the
teachers (in-process and behind a URL), the tokenizer check, and runs that distil."""

from __future__ import annotations

import json
import math

import pytest
import torch

from postrl.algorithms.distillation import reverse_kl_advantage, with_distillation
from postrl.config.loading import build_config
from postrl.config.run import ConfigError
from postrl.controller.failures import RewardFailureError
from postrl.models.loading import ModelNotFoundError
from postrl.train.teachers.teacher import TeacherFailure, TeacherQuery, TokenizerMismatchError
from tests.conftest import make_tiny_model


def test_reverse_kl_term_by_hand_in_float64():
    student = torch.tensor([[-1.2, -0.3, -2.5], [-0.05, -4.0, 0.0]])
    teacher = torch.tensor([[-0.7, -2.0, -0.1], [-0.05, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    got = reverse_kl_advantage(student, teacher, mask, weight=0.5)
    # 0.5 x (teacher - student), by hand; the masked tokens 0 whatever their logprobs
    expected = [[0.5 * (-0.7 + 1.2), 0.5 * (-2.0 + 0.3), 0.0], [0.0, 0.5 * (-1.0 + 4.0), 0.0]]
    assert got.dtype == torch.float32
    assert got.flatten().tolist() == pytest.approx([0.25, -0.85, 0.0, 0.0, 1.5, 0.0], abs=1e-6)
    assert got.flatten().tolist() == pytest.approx(torch.tensor(expected).flatten().tolist(), abs=1e-6)


def test_distillation_term_added_to_the_task_advantage_or_alone():
    term = torch.tensor([[0.1, -0.2], [0.3, 0.4], [1.0, 1.0]])
    taught = torch.tensor([True, True, False])  # the third row's teacher did not score it
    task = torch.tensor([1.0, -1.0, 0.5])
    assert with_distillation(task, term, taught).flatten().tolist() == pytest.approx([1.1, 0.8, -0.7, -0.6, 0.5, 0.5])
    assert with_distillation(None, term, taught).flatten().tolist() == pytest.approx([0.1, -0.2, 0.3, 0.4, 0.0, 0.0])
    per_token = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 3.0]])
    by_token = with_distillation(per_token, term, taught).flatten().tolist()
    assert by_token == pytest.approx([1.1, 1.8, 0.3, 0.4, 3.0, 3.0])


def test_distill_config_shapes_and_refusals():
    one = build_config({"algorithm": {"distill": {"teacher": "/models/big", "weight": 0.5}}}).algorithm.distill
    assert one is not None and [t.source for t in one.teachers] == ["/models/big"] and one.weight == 0.5
    assert one.teacher_for("anything") == 0 and one.name_of(0) == "teacher"
    several = build_config(
        {
            "algorithm": {
                "distill": {
                    "teachers": [
                        {"source": "/m/math", "name": "math", "applies_to": ["chain_sum", "products"]},
                        {"source": "http://127.0.0.1:9/v1", "applies_to": ["code"]},
                    ]
                }
            }
        }
    ).algorithm.distill
    assert several is not None
    assert [several.teacher_for(t) for t in ("products", "code", "poetry")] == [0, 1, None]
    assert [several.name_of(i) for i in range(2)] == ["math", "teacher_1"]
    with pytest.raises(ConfigError, match=r"teachers\[1\].applies_to: task 'products' is already taught by 'math'"):
        build_config(
            {
                "algorithm": {
                    "distill": {
                        "teachers": [
                            {"source": "/a", "name": "math", "applies_to": ["products"]},
                            {"source": "/b", "applies_to": ["products"]},
                        ]
                    }
                }
            }
        )
    with pytest.raises(ConfigError, match=r"teachers\[1\]: only one teacher may leave applies_to unset"):
        build_config({"algorithm": {"distill": {"teachers": [{"source": "/a"}, {"source": "/b"}]}}})
    with pytest.raises(ConfigError, match="give teacher \\(one\\) or teachers \\(a list\\), not both"):
        build_config({"algorithm": {"distill": {"teacher": "/a", "teachers": [{"source": "/b"}]}}})
    with pytest.raises(ConfigError, match="sourse"):
        build_config({"algorithm": {"distill": {"teachers": [{"sourse": "/a"}]}}})


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, char_tokenizer):
    """Another tiny Llama on the student's tokenizer: other weights (seed 1), and sure of itself (its
    tied embeddings x 8 sharpen its logits; a random tiny model's are nearly uniform)."""
    out = tmp_path_factory.mktemp("teacher")
    model = make_tiny_model("llama", char_tokenizer, seed=1)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    model.save_pretrained(out, safe_serialization=True)
    char_tokenizer.save_pretrained(out)
    return out


def test_local_teacher_gives_the_models_own_logprobs_of_the_response(teacher_dir, char_tokenizer):
    from transformers import AutoModelForCausalLM

    from postrl.train.teachers.local_teacher import LocalTeacher

    teacher = LocalTeacher(str(teacher_dir), "float32", torch.device("cpu"), 1.0, micro_batch_size=2)
    queries = [
        TeacherQuery(char_tokenizer("12+30=")["input_ids"] + char_tokenizer("42")["input_ids"], 6),
        TeacherQuery(char_tokenizer("7*8=")["input_ids"] + char_tokenizer("56;")["input_ids"], 4),
        TeacherQuery(char_tokenizer("1+1=")["input_ids"] + char_tokenizer("2")["input_ids"], 4),
        TeacherQuery(char_tokenizer("1+1=")["input_ids"] + char_tokenizer("11")["input_ids"], 4),  # its prompt again
    ]
    got = teacher.logprobs(queries)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    for q, answer in zip(queries, got, strict=True):
        assert not isinstance(answer, TeacherFailure)
        with torch.no_grad():
            logits = model(torch.tensor([q.ids])).logits[0].double()
        by_hand = torch.log_softmax(logits, -1)[
            torch.arange(q.start - 1, len(q.ids) - 1), torch.tensor(q.ids[q.start :])
        ]
        assert len(answer) == len(q.ids) - q.start
        assert answer == pytest.approx(by_hand.tolist(), abs=2e-5)
    bad = teacher.logprobs([TeacherQuery([1, 2, 3], 0)])  # a response starting at token 0 has no context
    assert isinstance(bad[0], TeacherFailure) and "outside its 3 tokens" in bad[0].reason


def reordered_char_tokenizer():
    """The char tokenizer's characters with other ids (its vocabulary reversed): the same split, other ids."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from postrl.tasks.char_tokenizer import SPECIAL

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"), reverse=True)
    vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([*SPECIAL])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def test_a_teacher_on_another_tokenizer_is_refused_naming_both(tmp_path, tiny_model_dir):
    from postrl.train.teachers.teachers import make_teachers

    other = tmp_path / "reordered-tokenizer-teacher"
    tokenizer = reordered_char_tokenizer()
    make_tiny_model("llama", tokenizer).save_pretrained(other, safe_serialization=True)
    tokenizer.save_pretrained(other)
    distill = build_config({"algorithm": {"distill": {"teacher": str(other)}}}).algorithm.distill
    from postrl.models.loading import load_tokenizer

    student = load_tokenizer(str(tiny_model_dir))
    with pytest.raises(TokenizerMismatchError) as caught:
        make_teachers(distill, student, str(tiny_model_dir), torch.device("cpu"), 1.0, 4)
    message = str(caught.value)
    with pytest.raises(
        ModelNotFoundError, match=r"algorithm.distill.teachers\[0\].source: no model folder at /no/teacher"
    ):
        make_teachers(
            build_config({"algorithm": {"distill": {"teacher": "/no/teacher"}}}).algorithm.distill,
            student,
            str(tiny_model_dir),
            torch.device("cpu"),
            1.0,
            4,
        )
    assert f"algorithm.distill.teachers[0] ({other})" in message and f"model.path={tiny_model_dir}" in message
    assert "does not share the student's tokenizer" in message and "reads the student's token ids" in message


def distill_run(
    tmp_path,
    student,
    data,
    distill,
    name,
    steps=2,
    lr=5e-2,
    n=4,
    max_tokens=6,
    checkpoint_every=0,
    reward="digit_share",
):
    from postrl.run.train_runner import train

    config = build_config(
        {
            "name": name,
            "output_dir": str(tmp_path),
            "steps": steps,
            "prompts_per_step": 4,
            "seed": 0,
            "model": {"path": str(student)},
            "data": {"train_files": [str(data)]},
            "rollout": {"n": n, "max_tokens": max_tokens, "dtype": "float32"},
            "reward": {"components": [{"type": "custom", "name": "digits", "function": f"tests.reward_fns:{reward}"}]},
            "algorithm": {"distill": distill},
            "train": {"lr": lr, "mini_batch_size": 4 * n, "micro_batch_size": 8, "precision": "float32"},
            "checkpoint": {"every_steps": checkpoint_every},
            "logging": {"trackers": ["jsonl"]},
        }
    )
    controller = train(config).controller
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    return controller, rows, config.run_dir


def test_distilling_from_the_students_own_weights_starts_at_zero_reverse_kl(tmp_path, tiny_model_dir, arithmetic_jsonl):
    _, rows, _ = distill_run(tmp_path, tiny_model_dir, arithmetic_jsonl, {"teacher": str(tiny_model_dir)}, "self")
    first, second = rows
    assert abs(first["distill/reverse_kl"]) < 1e-5  # the engine's and the teacher's float32 logprobs of one model
    assert abs(second["distill/reverse_kl"]) > 1e-3  # after an update (lr 5e-2) the student has moved
    for row in rows:
        assert row["distill/teacher_calls_per_sample"] == row["distill/teacher/samples"] / 16 <= 1.0
        assert row["distill/unscorable"] == 0.0 and row["distill/untaught"] == 0.0
        assert row["time/distill_s"] > 0.0


def first_token_reverse_kl(student, teacher, tokenizer, prompts: list[str]) -> float:
    """KL(student || teacher) of the first response token, exactly (whole distributions, float64),
    averaged over ``prompts``."""
    from transformers import AutoModelForCausalLM

    s, t = (AutoModelForCausalLM.from_pretrained(path).eval() for path in (student, teacher))
    total = 0.0
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            ls, lt = (torch.log_softmax(m(ids).logits[0, -1].double(), -1) for m in (s, t))
        total += float((ls.exp() * (ls - lt)).sum())
    return total / len(prompts)


def test_distillation_alone_brings_the_student_to_the_teacher(
    tmp_path, tiny_model_dir, teacher_dir, arithmetic_jsonl, char_tokenizer, monkeypatch
):
    from postrl.train.teachers.local_teacher import LocalTeacher

    sent: list[tuple] = []
    scored = LocalTeacher.logprobs
    monkeypatch.setattr(
        LocalTeacher, "logprobs", lambda self, qs: sent.extend((tuple(q.ids), q.start) for q in qs) or scored(self, qs)
    )
    # one-token answers, 64 samples a step: the reverse KL of that token is what the term descends
    prompts = [json.loads(line)["prompt"] for line in arithmetic_jsonl.read_text().splitlines()]
    before = first_token_reverse_kl(tiny_model_dir, teacher_dir, char_tokenizer, prompts)
    distill = {"teacher": str(teacher_dir), "task_reward": False}
    _, rows, run_dir = distill_run(
        tmp_path, tiny_model_dir, arithmetic_jsonl, distill, "alone", steps=10, lr=2e-2, n=16, max_tokens=1
    )
    after = first_token_reverse_kl(run_dir / "final_model", teacher_dir, char_tokenizer, prompts)
    assert before == pytest.approx(0.97880, abs=1e-4)  # two random models, the teacher sharpened
    assert after < 0.2 * before, (before, after)  # measured: 0.066 (a flipped sign raises it to 1.2 and more)
    # one-token answers repeat: each distinct sample was sent once in the whole run, its repeats kept
    assert len(sent) == len(set(sent)) and 10 < len(sent) < 640
    calls = [row["distill/teacher_calls_per_sample"] for row in rows]
    assert sum(c * 64 for c in calls) == pytest.approx(len(sent)) and all(c < 1.0 for c in calls)
    assert sum(row["distill/cached"] for row in rows) > 0  # answers kept from earlier steps were used


def test_a_task_no_teacher_applies_to_trains_on_its_reward_alone(
    tmp_path, tiny_model_dir, teacher_dir, arithmetic_jsonl
):
    distill = {"teachers": [{"source": str(teacher_dir), "name": "mul", "applies_to": ["mul"]}]}
    _, rows, _ = distill_run(tmp_path, tiny_model_dir, arithmetic_jsonl, distill, "untaught", steps=1)
    assert rows[0]["distill/untaught"] == 16.0 and rows[0]["distill/mul/samples"] == 0.0
    assert "distill/reverse_kl" not in rows[0]
    assert not math.isnan(rows[0]["reward/mean"])


@pytest.fixture
def teacher_server(teacher_dir, char_tokenizer):
    """``postrl serve-rollout``'s app over the native engine holding the teacher, on loopback."""
    from transformers import AutoModelForCausalLM

    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.batcher import EngineBatcher
    from postrl.serve.limits import ServerLimits
    from postrl.serve.openai_server import build_app
    from tests.test_serve import Server

    model = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(model, char_tokenizer, seed=0))
    server = Server(build_app(batcher, char_tokenizer, "teacher", max_context=128, limits=ServerLimits()))
    yield server
    server.stop()
    batcher.close()


def test_a_url_teacher_scores_as_the_model_does_through_echo(teacher_server, teacher_dir, char_tokenizer):
    from openai import OpenAI

    from postrl.train.teachers.http_teacher import HTTPTeacher
    from postrl.train.teachers.local_teacher import LocalTeacher
    from postrl.train.teachers.teachers import check_tokenizer

    ids = char_tokenizer("12+30=42")["input_ids"]  # <s> first: "42" are tokens 7 and 8
    # what the openai client reads: the prompt's tokens, the first without a logprob, then the completion's
    client = OpenAI(base_url=teacher_server.url + "/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model="teacher", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1 and len(lp.tokens) == len(ids) + 1
    assert answer.choices[0].text.startswith(char_tokenizer.decode(ids)) and answer.usage.prompt_tokens == len(ids)

    url = HTTPTeacher(teacher_server.url + "/v1", None, 30.0, None, 4)
    local = LocalTeacher(str(teacher_dir), "float32", torch.device("cpu"), 1.0, 4)
    queries = [TeacherQuery(ids, 7), TeacherQuery(char_tokenizer("7*8=56")["input_ids"], 5)]
    for by_url, by_folder in zip(url.logprobs(queries), local.logprobs(queries), strict=True):
        assert by_url == pytest.approx(by_folder, abs=2e-5)  # the engine's kernels against transformers'
    assert lp.token_logprobs[7:9] == pytest.approx(url.logprobs(queries[:1])[0], abs=1e-7)
    check_tokenizer(url, "algorithm.distill.teachers[0]", char_tokenizer, "student")  # one tokenizer: passes
    url.close()


def test_every_engine_the_server_runs_scores_prompts_alike(teacher_dir, char_tokenizer):
    from transformers import AutoModelForCausalLM

    from postrl.rollout.hf_engine import HFRolloutWorker
    from postrl.rollout.native import NativeRolloutWorker

    model = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    sequences = [char_tokenizer("12+30=42")["input_ids"], char_tokenizer("7*8=56;")["input_ids"]]
    native = NativeRolloutWorker.from_hf(model, char_tokenizer).prompt_logprobs(sequences)
    by_hf = HFRolloutWorker(model, char_tokenizer).prompt_logprobs(sequences)
    for a, b, ids in zip(native, by_hf, sequences, strict=True):
        assert len(a) == len(b) == len(ids) - 1 and a == pytest.approx(b, abs=2e-5)


def test_a_teacher_url_that_dies_mid_step_makes_samples_unscorable_not_the_run(
    tmp_path, tiny_model_dir, arithmetic_jsonl, teacher_server, monkeypatch
):
    from postrl.train.teachers.http_teacher import HTTPTeacher

    answered = []
    ask = HTTPTeacher._one

    def one(self, query):
        if len(answered) == 10:  # the teacher's server goes away after its tenth answer
            teacher_server.stop()
        answered.append(query)
        return ask(self, query)

    monkeypatch.setattr(HTTPTeacher, "_one", one)
    distill = {"teachers": [{"source": teacher_server.url, "timeout_s": 5.0, "concurrency": 1}]}
    with pytest.raises(RewardFailureError) as stopped:
        distill_run(tmp_path, tiny_model_dir, arithmetic_jsonl, distill, "dies", steps=3, checkpoint_every=1)
    run_dir = tmp_path / "dies"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1  # step 1 trained: 10 of its 16 samples taught, 6 unscorable (6/16 <= 0.5)
    assert rows[0]["distill/unscorable"] == 6.0 and rows[0]["reward/unscorable"] == 6.0  # counted as unscorable
    assert rows[0]["distill/teacher/samples"] == 16.0 and (run_dir / "checkpoints" / "step_00000001").is_dir()
    samples = [json.loads(line) for line in (run_dir / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert sum(f"teacher {teacher_server.url}" in (s["error"] or "") for s in samples) == 6
    # step 2: the teacher is gone, every sample unscorable: the run stops as with a dead reward service
    message = str(stopped.value)
    assert "step 2: 16/16 samples could not be scored" in message and f"teacher {teacher_server.url}" in message
    assert (run_dir / "unscored_step_2.jsonl").is_file()


def test_a_distillation_run_resumes_where_it_stopped(tmp_path, tiny_model_dir, teacher_dir, arithmetic_jsonl):
    from postrl.run.place import resume_config
    from postrl.run.train_runner import train

    _, rows, run_dir = distill_run(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        {"teacher": str(teacher_dir)},
        "resumed",
        steps=1,
        checkpoint_every=1,
    )
    resumed = train(resume_config(run_dir, ["steps=2"]), resume=True).controller
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert resumed.step_count == 2 and [r["step"] for r in rows] == [1, 2]
    assert rows[1]["distill/teacher/samples"] == 16.0 and rows[1]["distill/reverse_kl"] > 0.1


class ScriptedTeacher:
    """Gives each response token the logprob -0.5 x its position in the response; fails where told."""

    source = "scripted"

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.asked: list[TeacherQuery] = []

    def logprobs(self, queries):
        self.asked.extend(queries)
        return [
            TeacherFailure("no") if q.ids[q.start] == self.fail_on else [-0.5 * i for i in range(len(q.ids) - q.start)]
            for q in queries
        ]

    def close(self) -> None:
        pass


def test_an_episodes_tool_tokens_get_no_distillation_term_and_its_model_tokens_theirs(tmp_path):
    """The stage on an episode (tool output inside the response) and a sample its teacher fails on,
    then the advantage stage: by hand."""
    from postrl.config.algorithm import AlgorithmConfig
    from postrl.controller.advantage import compute_advantage
    from postrl.controller.stages.distill import Distillation
    from postrl.train.teachers.teachers import TeacherSet
    from postrl.types import Prompt, RewardResult, Rollout, StepBatch

    algorithm = AlgorithmConfig.model_validate({"distill": {"teacher": "scripted", "weight": 2.0}})
    teacher = ScriptedTeacher(fail_on=9)
    stage = Distillation(TeacherSet(algorithm.distill, [teacher]), algorithm.distill, tmp_path, max_failure_rate=0.5)
    episode = Rollout(
        0, [7, 8], [1, 2, 3, 4, 5], [-0.1, -0.2, 0.0, 0.0, -0.3], "", "stop", 0, loss_mask=[1, 1, 0, 0, 1]
    )
    plain = Rollout(0, [7, 8], [6, 6], [-1.0, -2.0], "", "stop", 0)
    failed = Rollout(0, [7, 8], [9, 9], [-1.0, -1.0], "", "stop", 0)
    rewards = [RewardResult(1.0), RewardResult(0.0), RewardResult(0.0)]
    step = StepBatch.build([Prompt("p", [7, 8])], [episode, plain, failed], rewards, pad_id=0)
    metrics = stage.prepare(step)
    spans = step.spans
    # 2 x (teacher - student) on the model's tokens; the tool's (positions 2, 3) 0 whatever the teacher says
    assert step.distill[0, spans[0]].tolist() == pytest.approx([0.2, -0.6, 0.0, 0.0, -3.4])
    assert step.distill[1, spans[1]].tolist() == pytest.approx([2.0, 3.0])
    assert step.taught.tolist() == [True, True, False] and step.unscorable.tolist() == [False, False, True]
    assert step.results[2].error == "no" and step.batch.loss_mask[2].sum() == 0
    assert metrics["distill/unscorable"] == 1.0 and metrics["distill/teacher/samples"] == 3.0
    # reverse KL over the 5 taught model tokens, student - teacher, by hand
    gap = [-0.1 - 0.0, -0.2 + 0.5, -0.3 + 2.0, -1.0 - 0.0, -2.0 + 0.5]
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(gap) / 5)
    compute_advantage(step, algorithm)  # the task's advantage alone: the stage adds its term after it
    assert step.batch.advantages[1, spans[1]].tolist() == pytest.approx([-1 / (math.sqrt(0.5) + 1e-6) * 0.5] * 2)
    assert stage.after_advantage(step) == {}
    # GRPO over the two scorable rewards (1, 0): +-0.7071 (unbiased std), plus the term; the failed row 0
    # (the tool's tokens keep the outcome's advantage, as without distillation: their loss mask is 0)
    grpo = 1 / (math.sqrt(0.5) + 1e-6) * 0.5
    expected = [grpo + 0.2, grpo - 0.6, grpo, grpo, grpo - 3.4]
    assert step.batch.advantages[0, spans[0]].tolist() == pytest.approx(expected)
    assert step.batch.loss_mask[0, spans[0]].tolist() == [1, 1, 0, 0, 1]
    assert step.batch.advantages[1, spans[1]].tolist() == pytest.approx([-grpo + 2.0, -grpo + 3.0])
    assert step.batch.advantages[2, spans[2]].tolist() == [0.0, 0.0]


@pytest.mark.serial
@pytest.mark.slow
def test_under_ray_a_folder_teacher_is_an_actor_of_its_own(tmp_path, tiny_model_dir, arithmetic_jsonl, monkeypatch):
    """Issue 59: the teachers are a role the scheduler places: under Ray a folder teacher computes in
    an actor (the train role's resources), not in the driver; the run's distillation is the same
    (the student's own weights as teacher: reverse KL 0 at the first step)."""
    ray = pytest.importorskip("ray")
    from postrl.run.train_runner import train
    from postrl.scheduling.ray_actors import RayHandle
    from tests.test_ray import ray_processes

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    config = build_config(
        {
            "name": "ray-teacher",
            "output_dir": str(tmp_path),
            "steps": 1,
            "prompts_per_step": 2,
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_files": [str(arithmetic_jsonl)]},
            "rollout": {"n": 2, "max_tokens": 6, "dtype": "float32", "device": "cpu"},
            "reward": {"components": [{"type": "custom", "name": "d", "function": "tests.reward_fns:digit_share"}]},
            "algorithm": {"distill": {"teacher": str(tiny_model_dir)}},
            "train": {"mini_batch_size": 4, "micro_batch_size": 4, "precision": "float32", "device": "cpu"},
            "checkpoint": {"every_steps": 0},
            "logging": {"trackers": ["jsonl"]},
            "scheduler": {"type": "ray", "train": {"threads": 1}, "rollout": {"threads": 1}},
        }
    )
    job = train(config)
    teachers = job.controller.parts.teachers
    assert teachers is not None and isinstance(teachers.handle, RayHandle) and teachers.names == ["teacher"]
    (row,) = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert abs(row["distill/reverse_kl"]) < 1e-5 and row["distill/teacher/samples"] == 4.0
    assert not ray.is_initialized() and ray_processes() == []
