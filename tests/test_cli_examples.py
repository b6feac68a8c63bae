"""Issue 8 item 10: command-line help that answers questions, and every example config runs."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from postrl.cli import build_parser, main
from tests.test_serve import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TRAIN_EXAMPLES = [
    "arithmetic_grpo.yaml",
    "math_jsonl.yaml",
    "smollm2_grpo.yaml",
    "mixed_math_code.yaml",
    "dapo.yaml",
    "calculator_agent.yaml",
    "reasoning_gym_grpo.yaml",
    *sorted(
        f"algorithms/{p.name}" for p in (Path(__file__).resolve().parents[1] / "examples" / "algorithms").glob("*.yaml")
    ),
]
SERVICE_EXAMPLES = ["reward_service.yaml", "code_reward_service.yaml"]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_and_its_default():
    defaults_checked = 0
    for name, sub in _subcommands().items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"postrl {name} {action.dest} has no help text"
        text = sub.format_help()
        for action in sub._actions:
            if action.option_strings and action.default not in (None, argparse.SUPPRESS, False) and action.help:
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.dest)
                defaults_checked += 1
    assert defaults_checked >= 10  # the loop above checked real options
    train_help = " ".join(_subcommands()["train"].format_help().split())
    assert (
        "The run directory is OUTPUT_DIR/NAME (config fields output_dir, default 'runs', and name, default 'run')"
        in train_help
    )
    eval_help = " ".join(_subcommands()["eval"].format_help().split())
    assert "{arithmetic}" in eval_help and "arithmetic: 3-digit addition" in eval_help


def test_verbose_flag_works_before_and_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["-v", "eval", "--model", "demo"]).verbose is True
    assert parser.parse_args(["eval", "--model", "demo", "-v"]).verbose is True
    assert getattr(parser.parse_args(["eval", "--model", "demo"]), "verbose", False) is False


def _example_overrides(tmp_path: Path) -> list[str]:
    return [
        f"output_dir={tmp_path / 'runs'}",
        "steps=1",
        "prompts_per_step=2",
        "rollout.n=2",
        "train.mini_batch_size=4",
        "train.micro_batch_size=2",
        "logging.progress_bar=true",
    ]


@pytest.mark.parametrize("name", TRAIN_EXAMPLES)
def test_train_example_runs(name, tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(REPO)  # the examples name their data relative to the repository
    extra = ["rollout.max_tokens=8"]
    if name == "smollm2_grpo.yaml":  # the real model needs scripts/setup_bench.sh; its shape does not matter here
        from postrl.tasks.chat_addition import write_jsonl

        data = tmp_path / "addition.jsonl"
        write_jsonl(str(data), 8)
        extra = [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{data}]",
            "data.max_prompt_tokens=100",
            "rollout.dtype=float32",
            "rollout.max_tokens=8",
        ]
    if name == "calculator_agent.yaml":  # the warm-started model is built by a script; any char model runs
        extra = [f"model.path={tiny_model_dir}", "agent.max_tokens_per_turn=8", "prompts_per_step=4", "data.val_size=4"]
    if name == "reasoning_gym_grpo.yaml":  # SmolLM2 needs setup_bench.sh; the char model's context is 128 tokens
        extra = [f"model.path={tiny_model_dir}", "data.reasoning_gym.chat_template=false", "data.on_bad_row=skip",
                 "data.reasoning_gym.instruction=", "data.max_prompt_tokens=118", "rollout.max_tokens=8",
                 "prompts_per_step=4", "data.reasoning_gym.size=60", "data.reasoning_gym.val_size=12",
                 "rollout.n=2", "train.mini_batch_size=8", "train.micro_batch_size=8",
                 "data.eval_sets=[]"]  # fmt: skip
    if name == "mixed_math_code.yaml":
        extra += ["prompts_per_step=8", "train.mini_batch_size=16", "train.micro_batch_size=8"]  # every row once
    assert main(["train", str(EXAMPLES / name), *_example_overrides(tmp_path), *extra]) == 0
    run = next((tmp_path / "runs").iterdir())
    assert (run / "final_model" / "config.json").is_file()
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    if name.startswith("algorithms/") or name == "dapo.yaml":
        assert math.isfinite(first["actor/loss"]) or name == "algorithms/ppo.yaml"
    if name == "calculator_agent.yaml":  # whole episodes, scored by the environment
        assert first["agent/turns_mean"] >= 1 and "reward/environment/mean" in first
    if name == "mixed_math_code.yaml":  # each component scored its own rows
        assert {"reward/math/mean", "reward/code/mean"} <= set(first)


@pytest.mark.slow
def test_dpo_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert (
        main(
            [
                "dpo",
                str(EXAMPLES / "dpo.yaml"),
                f"output_dir={tmp_path / 'runs'}",
                "epochs=1",
                "train.mini_batch_size=256",
                "train.micro_batch_size=128",
                "logging.trackers=[jsonl]",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["dpo/reward_accuracy"] > 0.5  # 512 pairs, 256 a step


@pytest.mark.slow
def test_progress_output_to_a_file_has_no_carriage_returns(tmp_path):
    log = tmp_path / "train.log"
    with log.open("w") as fh:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "postrl.cli",
                "train",
                str(EXAMPLES / "arithmetic_grpo.yaml"),
                *_example_overrides(tmp_path),
                "steps=2",
            ],
            cwd=REPO,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    text = log.read_text()
    assert done.returncode == 0, text
    assert "\r" not in text
    assert "step 1/2 | reward" in text and "step 2/2 | reward" in text


@pytest.mark.parametrize("name", SERVICE_EXAMPLES)
@pytest.mark.slow
def test_reward_service_example_serves(name):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "postrl.cli", "serve-reward", "--config", str(EXAMPLES / name), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        while True:
            line = proc.stdout.readline()
            assert line, f"server exited: {''.join(lines)} {proc.stderr.read()}"
            lines.append(line)
            if line.startswith("reward service on "):
                break
        assert f"http://127.0.0.1:{port}" in line
        if name == "reward_service.yaml":
            sample = {"prompt": "What is 6*7?", "response": "\\boxed{42}", "columns": {"answer": "42"}}
            expected = 1.1
        else:
            sample = {
                "prompt": "p",
                "response": "```python\ndef f(x):\n    return x + 1\n```",
                "columns": {"tests": ["assert f(1) == 2", "assert f(2) == 4"]},
            }
            expected = 0.5
        r = httpx.post(f"http://127.0.0.1:{port}/score", json={"samples": [sample]}, timeout=60)
        assert r.status_code == 200 and r.json()["results"][0]["reward"] == pytest.approx(expected)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
