"""Reward components: code, reward models, judges, mixing, the pool under threads, the failure-rate stop."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from postrl.cli import main
from postrl.config.loading import build_config
from postrl.config.run import ConfigError, RewardConfig
from postrl.reward.code import extract_program, parse_tests
from postrl.reward.pool import ScoringPool
from postrl.reward.service import LocalRewardService, ScoreRequest
from tests.http_stub import LoopbackJSONServer
from tests.test_reward_server import start_server, stop_server
from tests.test_train_e2e import write_config


def test_extract_program_and_parse_tests():
    text = "Here:\n```js\nconsole.log(1)\n```\nand\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nx = 1\n```") == "x = 1\n"
    assert extract_program("x = 3") == "x = 3"
    assert parse_tests('["assert f(1) == 1"]') == ("assert", ["assert f(1) == 1"])
    assert parse_tests({"inputs": ["1"], "outputs": ["2"]}) == ("io", [{"input": "1", "output": "2"}])
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_tests({"inputs": ["1", "2"], "outputs": ["2"]})
    with pytest.raises(ValueError, match="mixes shapes"):
        parse_tests(["assert True", {"input": "", "output": ""}])
    with pytest.raises(ValueError, match="not JSON"):
        parse_tests("assert True")


def test_code_component_all_or_nothing_and_bad_tests_are_unscorable():
    svc = LocalRewardService(
        RewardConfig(
            num_workers=1,
            components=[{"name": "code", "type": "code", "code_score": "all_or_nothing", "sandbox": {"wall_s": 3}}],
        )
    )
    try:
        half = "def f(x):\n    return x if x < 2 else 0"
        tests = ["assert f(1) == 1", "assert f(3) == 3"]
        out = svc.score_batch(
            [
                ScoreRequest("", half, {"tests": tests}),
                ScoreRequest("", "def f(x):\n    return x", {"tests": tests}),
                ScoreRequest("", half, {"tests": "not json"}),
                ScoreRequest("", half, {}),
            ]
        )
    finally:
        svc.close()
    assert out[0].reward == 0.0 and "test 1: AssertionError" in out[0].reasons["code"]
    assert out[1].reward == 1.0
    assert out[2].unscorable and "not JSON" in out[2].error
    assert out[3].unscorable and "no 'tests' column" in out[3].error
    assert svc.sandbox_protections["resource_limits"] is True


def test_local_reward_model_scores_in_batches(tmp_path, char_tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(char_tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=char_tokenizer.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    char_tokenizer.save_pretrained(tmp_path / "rm")
    svc = LocalRewardService(
        RewardConfig(components=[{"name": "rm", "type": "reward_model", "path": str(tmp_path / "rm")}])
    )
    pairs = [("1+1=", "2"), ("2+2=", "45"), ("3+3=", "6")]
    batched = svc.score_batch([ScoreRequest(p, r, {}) for p, r in pairs])
    alone = [svc.score(p, r) for p, r in pairs]
    assert [b.reward for b in batched] == pytest.approx([a.reward for a in alone], abs=1e-5)
    assert len({round(b.reward, 6) for b in batched}) == 3  # a real model output, not a constant
    # the model reads the conversation in its chat template, as reward models are trained
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    text = char_tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "45"}], tokenize=False
    )
    assert "<|im_start|>assistant" in text
    with torch.no_grad():
        expected = model(**char_tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
    assert batched[1].reward == pytest.approx(expected, abs=1e-5)
    svc.close()


def test_components_apply_to_their_task_types():
    svc = LocalRewardService(
        RewardConfig(
            num_workers=1,
            components=[
                {"name": "math", "type": "math", "applies_to": ["math"]},
                {"name": "code", "type": "code", "applies_to": ["code"], "sandbox": {"wall_s": 5}},
                {
                    "name": "format",
                    "type": "format",
                    "weight": 0.5,
                    "pattern": "(?s).+",
                    "applies_to": ["math", "code"],
                },
            ],
        )
    )
    try:
        out = svc.score_batch(
            [
                ScoreRequest("2*3?", "\\boxed{6}", {"task_type": "math", "answer": "6"}),
                ScoreRequest(
                    "f?", "```python\ndef f():\n    return 1\n```", {"task_type": "code", "tests": ["assert f() == 1"]}
                ),
                ScoreRequest("poem?", "roses", {"task_type": "poetry"}),
            ]
        )
    finally:
        svc.close()
    assert out[0].components == {"math": 1.0, "format": 1.0} and out[0].reward == 1.5
    assert out[1].components == {"code": 1.0, "format": 1.0} and out[1].reward == 1.5
    assert out[2].unscorable and out[2].error == (
        "no reward component applies to task_type 'poetry' (see reward.components[].applies_to)"
    )


def test_remote_reward_model_and_judge_mix_with_weights(monkeypatch):
    rm = LoopbackJSONServer(lambda method, path, body: (200, {"scores": [float(len(r)) for r in body["responses"]]}))

    def chat(method, path, body):
        content = body["messages"][0]["content"]
        text = "Score: 8" if "GOOD" in content else ("I refuse" if "ODD" in content else "Score: 2")
        return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}

    judge = LoopbackJSONServer(chat)
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    svc = LocalRewardService(
        RewardConfig(
            components=[
                {"name": "rm", "type": "remote_reward_model", "url": rm.url + "/rm", "weight": 0.1},
                {
                    "name": "judge",
                    "type": "judge",
                    "url": judge.url + "/v1",
                    "model": "judge-1",
                    "api_key_env": "JUDGE_KEY",
                    "prompt_template": "Q: {prompt} A: {response} ref {answer}",
                },
            ]
        )
    )
    try:
        out = svc.score_batch(
            [
                ScoreRequest("q1", "GOOD", {"answer": "4"}),
                ScoreRequest("q2", "bad", {"answer": "5"}),
                ScoreRequest("q3", "ODD", {"answer": "6"}),
            ]
        )
    finally:
        svc.close()
        rm.close()
        judge.close()
    assert out[0].components == {"rm": 4.0, "judge": 0.8} and out[0].reward == pytest.approx(0.4 + 0.8)
    assert out[1].reward == pytest.approx(0.3 + 0.2)
    assert out[2].unscorable and "judge: judge answer has no score" in out[2].error
    sent = [b for b in judge.requests if b["path"] == "/v1/chat/completions"]
    assert sent[0]["model"] == "judge-1" and sent[0]["auth"] == "Bearer sk-test"
    assert {b["messages"][0]["content"] for b in sent} >= {"Q: q1 A: GOOD ref 4"}


def test_component_config_errors_name_the_field():
    with pytest.raises(ConfigError) as err:
        build_config({"reward": {"components": [{"name": "j", "type": "judge"}]}})
    assert str(err.value).splitlines()[1:] == [
        "  config field 'reward.components.0.url' is required",
        "  config field 'reward.components.0.model' is required",
    ]
    with pytest.raises(ConfigError, match=r"duplicate names \['a'\]"):
        build_config(
            {
                "reward": {
                    "components": [{"name": "a", "type": "format"}, {"name": "a", "type": "length", "target_tokens": 4}]
                }
            }
        )
    with pytest.raises(ConfigError, match="reward.components.0.*'magic'.*'exact_match'"):
        build_config({"reward": {"components": [{"name": "a", "type": "magic"}]}})
    with pytest.raises(ConfigError, match="function='score' must look like 'package.module:function'"):
        build_config({"reward": {"components": [{"name": "a", "type": "custom", "function": "score"}]}})


def test_pool_shared_by_threads_keeps_each_callers_order():
    with ScoringPool(num_workers=2, timeout_s=2.0) as pool:

        def run(t: int) -> list:
            jobs = [
                {"fn": "tests.reward_fns:length_score", "prompt": "", "response": "x" * (t * 100 + i), "columns": {}}
                for i in range(50)
            ]
            return [r.value for r in pool.map(jobs)]

        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(run, range(8)))
    assert results == [[float(t * 100 + i) for i in range(50)] for t in range(8)]


def test_failure_rate_stops_the_run_and_keeps_the_samples(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    reward = {
        "components": [{"name": "v", "type": "custom", "function": "tests.reward_fns:raises"}],
        "num_workers": 1,
        "max_failure_rate": 0.5,
    }
    config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, reward=reward)
    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    assert "step 1: 16/16 samples could not be scored (100% > reward.max_failure_rate=0.5)" in err
    assert "16x v: ValueError: bad response" in err
    saved = (tmp_path / "runs" / "tiny" / "unscored_step_1.jsonl").read_text().splitlines()
    assert len(saved) == 16 and "response" in json.loads(saved[0])


@pytest.mark.slow
def test_training_through_the_remote_reward_service(tmp_path, tiny_model_dir, arithmetic_jsonl):
    server_config = {
        "reward": {
            "num_workers": 1,
            "components": [{"name": "answer", "type": "exact_match"}, {"name": "fmt", "type": "format", "weight": 0.1}],
        }
    }
    proc, url = start_server(tmp_path, server_config)
    try:
        config = write_config(tmp_path, tiny_model_dir, arithmetic_jsonl, reward={"remote": {"url": url}}, steps=2)
        assert main(["train", config]) == 0
    finally:
        stop_server(proc)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert "reward/answer/mean" in rows[-1] and "reward/fmt/mean" in rows[-1] and "accuracy" in rows[-1]


def test_dead_remote_service_fails_fast_with_the_url(tmp_path, tiny_model_dir, arithmetic_jsonl, capsys):
    config = write_config(
        tmp_path,
        tiny_model_dir,
        arithmetic_jsonl,
        reward={"remote": {"url": "http://127.0.0.1:9", "retries": 1, "backoff_s": 0.01}},
    )
    assert main(["train", config]) == 2
    # refused before anything is written, naming the URL
    assert "reward.remote.url=http://127.0.0.1:9 cannot be reached (Connection refused)" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "tiny").exists()


def test_one_accuracy_rule_for_training_validation_and_eval():
    """The share of samples whose accuracy component reaches the threshold; an unscorable sample is a
    miss; no accuracy component (or nothing scored) is no accuracy, not a guess from the reward."""
    from postrl.reward.accuracy import accuracy
    from postrl.types import RewardResult

    results = [
        RewardResult(1.0, components={"acc": 1.0}),
        RewardResult(0.5, components={"acc": 0.5}),
        RewardResult(None, error="timeout"),
        RewardResult(1.0, components={"acc": 1.0}),
    ]
    assert accuracy(results, "acc", 1.0) == 2 / 4
    assert accuracy(results, "acc", 0.5) == 3 / 4
    assert accuracy(results, None, 1.0) is None
    assert accuracy([RewardResult(None, error="x")], "acc", 1.0) is None


def sandbox_user_processes(uid: int) -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0, reason="jails share one process limit only as the one user a root service drops to"
)
def test_cases_that_cannot_start_while_another_jail_holds_the_process_limit_make_the_sample_unscorable():
    """RLIMIT_NPROC counts every process of the sandbox user: while a fork bomb in one jail holds
    it, another jail's stdin/stdout cases cannot fork. That sample is unscorable (its verdicts say
    nothing about its program), not scored 0; once the bomb's wall clock ends it, the same program
    scores its fraction."""
    from postrl.reward.code import code_reward
    from postrl.reward.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError, probe_protections

    uid = probe_protections().unprivileged_user[0]
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    bomb_jail = Sandbox(SandboxLimits(wall_s=3.0, cpu_s=3, processes=16))
    with ThreadPoolExecutor(1) as pool:
        bombing = pool.submit(bomb_jail.run, bomb, ["assert True"], "assert")
        deadline = time.monotonic() + 20
        while sandbox_user_processes(uid) < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        program = "n = int(input())\nprint(n * 2)"
        tests = json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["6\n", "21\n"]})
        sandbox = {"wall_s": 0.4, "processes": 16}
        with pytest.raises(SandboxUnavailableError, match="process limit stayed reached"):
            code_reward("", program, sandbox=sandbox, tests=tests)
        assert bombing.result().timed_out
    assert code_reward("", program, sandbox={"wall_s": 4.0, "processes": 16}, tests=tests) == (
        0.5,
        "test 1: wrong output",
    )
