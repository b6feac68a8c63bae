"""OpenEnv servers as environments (``agent.env: openenv:URL``): a real server process written
against openenv-core's server API (examples/openenv/guess_server.py), driven through OpenEnv's own client."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openenv.core", reason="openenv-core is in the test extras (pip install -e '.[test]')")

from postrl.rollout.agentic.env_lookup import environment_factory  # noqa: E402
from postrl.rollout.agentic.episode_ops import EpisodeLimits  # noqa: E402
from postrl.rollout.agentic.openenv_env import OpenEnvEnvironment  # noqa: E402
from tests.chat_templates import family_tokenizer  # noqa: E402
from tests.test_agentic import run_script  # noqa: E402
from tests.test_mcp_tools import free_port  # noqa: E402

SERVER = Path(__file__).resolve().parents[1] / "examples" / "openenv" / "guess_server.py"


def start(kind: str = "game") -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port), kind], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the OpenEnv test server did not start")


@pytest.fixture(scope="module")
def game():
    proc, url = start()
    yield url
    proc.terminate()
    proc.wait(10)


def test_an_episode_is_reset_and_stepped_through_openenv_s_client(game):
    env = environment_factory(f"openenv:{game}")(reset_columns=["seed"])
    try:
        assert isinstance(env, OpenEnvEnvironment)
        assert env.reset({"prompt": "", "seed": 17}) == [{"role": "user", "content": "Guess a digit from 0 to 9."}]
        assert env.action_field == "guess"  # the one text field of the server's action schema
        wrong = env.step("I guess 5")
        assert wrong.messages == [{"role": "user", "content": "No: higher."}] and not wrong.done
        assert wrong.reward == 0.0
        right = env.step("7")
        assert right.done and right.reward == 1.0 and right.messages == []
    finally:
        env.close()


def test_episodes_on_an_openenv_server_are_the_engine_s_tokens_and_end_on_its_done(game):
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok.encode(t, add_special_tokens=False) + [end] for t in ("5", "3")]
    make = environment_factory(f"openenv:{game}")
    rollouts = run_script(
        tok, turns, env=lambda **_: make(reset_columns=["seed"]), n=2, row={"seed": 3}, limits=EpisodeLimits(5)
    )
    for r in rollouts:
        assert r.finish_reason == "stop" and r.episode.reward == 1.0 and len(r.episode.turns) == 2
        assert [m["content"] for m in r.episode.messages] == [
            "Hi",
            "Guess a digit from 0 to 9.",
            "5",
            "No: lower.",
            "3",
        ]
        assert r.response_ids[: len(turns[0])] == turns[0] and r.response_ids[-len(turns[1]) :] == turns[1]
        delta = r.response_ids[len(turns[0]) : -len(turns[1])]
        assert tok.decode(delta) == "\n<|im_start|>user\nNo: lower.<|im_end|>\n<|im_start|>assistant\n"
        assert r.loss_mask == [1] * len(turns[0]) + [0] * len(delta) + [1] * len(turns[1])


def failed(url: str, env_timeout_s: float = 20.0) -> dict:
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok.encode("5", add_special_tokens=False) + [end]]
    make = environment_factory(f"openenv:{url}")
    limits = EpisodeLimits(3, env_timeout_s=env_timeout_s)
    (r,) = run_script(tok, turns, env=lambda **_: make(message_timeout_s=60), n=1, limits=limits)
    assert r.finish_reason == "env_error", r.episode.info
    return r.episode.info


@pytest.mark.slow  # three servers started, one waited out
def test_a_server_that_is_down_slow_or_malformed_fails_the_episode_with_its_reason():
    down = failed(f"http://127.0.0.1:{free_port()}")  # nothing listens
    assert down["env_failed_in"] in ("make", "reset") and "ConnectError" in down["env_reason"], down
    slow, url = start("slow")
    try:
        began = time.monotonic()
        info = failed(url, env_timeout_s=2)
        assert time.monotonic() - began < 10
        assert info["env_failed_in"] == "step" and "timed out after 2 s" in info["env_reason"], info
    finally:
        slow.kill()
    blank, url = start("blank")
    try:
        info = failed(url)
        assert info["env_reason"].endswith(f"OpenEnv server {url}: a reply without an observation to show"), info
    finally:
        blank.kill()


def test_an_openenv_spec_that_is_not_a_url_is_refused():
    with pytest.raises(ValueError, match=r"openenv:guess: give the server's URL \(openenv:http://host:port\)"):
        environment_factory("openenv:guess")


def train_on(env: str, tmp_path: Path, model_dir: Path, steps: int) -> list[dict]:
    """``postrl train`` of ``steps`` steps on the guessing game at ``env``: its metrics rows."""
    from postrl.cli import main

    rows = tmp_path / "seeds.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "Play.", "seed": s}) + "\n" for s in range(8)))
    config = tmp_path / "openenv.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            model: {{path: {model_dir}}}
            data: {{train_files: [{rows}]}}
            output_dir: {tmp_path / "runs"}
            name: guess
            import_paths: [{SERVER.parent}]
            steps: {steps}
            prompts_per_step: 2
            rollout: {{n: 2, max_tokens: 4}}
            train: {{mini_batch_size: 4, micro_batch_size: 4}}
            agent:
              env: {env}
              env_options: {{reset_columns: [seed]}}
              max_turns: 3
              max_tokens_per_turn: 4
              max_context: 128
            """
        )
    )
    assert main(["train", str(config)]) == 0
    return [json.loads(line) for line in (tmp_path / "runs" / "guess" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a whole run
def test_postrl_train_on_an_openenv_server(game, tmp_path, tiny_model_dir):
    metrics = train_on(f"openenv:{game}", tmp_path, tiny_model_dir, steps=2)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["agent/turns_mean"] >= 1 for m in metrics)


def server_processes(app: str) -> list[str]:
    """Live processes serving ``app`` (uvicorn's command line names it)."""
    out = subprocess.run(["ps", "-ww", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"uvicorn {app}" in line and not line.startswith("Z")]


@pytest.mark.slow  # a whole run
def test_postrl_serves_an_openenv_app_itself_and_stops_it_with_the_run(tmp_path, tiny_model_dir):
    """``openenv:module:app``: postrl starts the server, plays its episodes, and nothing of it is left
    after the run."""
    metrics = train_on("openenv:guess_server:app", tmp_path, tiny_model_dir, steps=1)
    assert metrics[0]["agent/turns_mean"] >= 1 and metrics[0]["reward/unscorable"] == 0
    assert server_processes("guess_server:app") == []


def test_an_openenv_app_that_does_not_start_is_refused_naming_it():
    from postrl.rollout.agentic.openenv_server import LocalOpenEnvServer, OpenEnvServerError

    with pytest.raises(OpenEnvServerError) as got:
        LocalOpenEnvServer("tests.no_such_server:app")
    assert str(got.value).startswith(
        "agent.env: openenv:tests.no_such_server:app: the server exited (3) before it answered"
    )
    assert 'Could not import module "tests.no_such_server"' in str(got.value)
    assert server_processes("tests.no_such_server:app") == []


def test_a_session_past_the_server_s_capacity_fails_its_reset_saying_so():
    """The server takes 16 sessions at once (max_concurrent_envs); the 17th is closed at its reset.
    A server of its own: the module's may still hold the sessions of the tests before."""
    proc, url = start()
    envs = [environment_factory(f"openenv:{url}")(reset_columns=["seed"]) for _ in range(17)]
    try:
        for env in envs[:16]:
            env.reset({"prompt": "", "seed": 1})
        # the server sends its refusal, then closes: a client reads the refusal (OpenEnv's own error) or,
        # where the close comes first, postrl names it
        refused = r"Server at capacity: 16/16 sessions|closed the session at reset: a server at its max_concurrent_envs"
        with pytest.raises((RuntimeError, ConnectionError), match=refused):
            envs[16].reset({"prompt": "", "seed": 1})
    finally:
        for env in envs:
            env.close()
        proc.terminate()
        proc.wait(10)
