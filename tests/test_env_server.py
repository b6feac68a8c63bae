"""``postrl serve-env``: the calculator environment in its own process over HTTP; an episode
through it gives the same trajectory as the environment in-process, a bad token is refused, a
malformed body names its field."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from postrl.rollout.agentic.env_lookup import environment_factory
from postrl.rollout.agentic.remote_env import EnvironmentServiceError
from tests.chat_templates import family_tokenizer
from tests.test_agentic import run_script
from tests.test_reward_server import start_cli_server, stop_server

TOKEN = "env-token-7"


def start_env_server() -> tuple[subprocess.Popen, str]:
    args = ["serve-env", "calculator", "--token-env", "ENV_TOKEN"]
    return start_cli_server(args, {"ENV_TOKEN": TOKEN}, TOKEN)


@pytest.fixture(scope="module")
def env_server():
    proc, url = start_env_server()
    yield url
    stop_server(proc)


@pytest.mark.slow
def test_an_episode_over_http_is_the_same_trajectory_as_in_process(env_server, monkeypatch):
    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    turns = [
        tok.encode(call, add_special_tokens=False) + [end],
        tok.encode("<answer>408</answer>", add_special_tokens=False) + [end],
    ]
    remote = environment_factory(env_server)
    local = run_script(tok, turns, lambda **_: environment_factory("calculator")(), 2, row={"answer": "408"})
    served = run_script(tok, turns, lambda **_: remote(token_env="ENV_TOKEN"), 2, row={"answer": "408"})
    assert [(r.prompt_ids, r.response_ids, r.loss_mask) for r in served] == [
        (r.prompt_ids, r.response_ids, r.loss_mask) for r in local
    ]
    assert [r.episode.reward for r in served] == [1.0, 1.0] and served[0].episode.tool_calls == 1
    assert served[0].episode.turns[0].tool_calls[0].name == "calculator"
    assert httpx.get(env_server + "/health", headers={"Authorization": f"Bearer {TOKEN}"}).json()["episodes"] == 0


def test_a_bad_token_and_a_bad_body_are_refused(env_server, monkeypatch):
    assert (
        httpx.post(env_server + "/episodes", json={"row": {}}, headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    assert httpx.post(env_server + "/episodes", json={"row": {}}).status_code == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    reply = httpx.post(env_server + "/episodes", json={"rows": {}}, headers=good)
    assert reply.status_code == 422 and "row" in reply.json()["detail"]
    assert httpx.post(env_server + "/episodes/ep-999/step", json={"action": "x"}, headers=good).status_code == 404
    monkeypatch.setenv("WRONG_TOKEN", "nope")
    env = environment_factory(env_server)(token_env="WRONG_TOKEN")
    with pytest.raises(EnvironmentServiceError, match="401"):
        env.reset({"prompt": "1*2", "answer": "2", "messages": None})
    env.close()


@pytest.mark.slow
def test_an_episode_saved_on_one_server_goes_on_on_another(monkeypatch):
    """Suspend and resume across a restart: the episode's state from the first server, restored on
    a second after the first stopped, is scored as if nothing happened."""
    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    first, url = start_env_server()
    env = environment_factory(url)(token_env="ENV_TOKEN")
    env.reset({"prompt": "12*34", "answer": "408", "messages": None})
    assert env.step('calculator(expression="12*34")').messages[0]["content"] == "408"
    saved = env.state_dict()
    stop_server(first)
    second, url = start_env_server()
    try:
        again = environment_factory(url)(token_env="ENV_TOKEN")
        again.load_state_dict(saved)
        assert [t.name for t in again.tools] == ["calculator"]
        assert again.step("<answer>408</answer>").reward == 1.0
        again.close()
    finally:
        stop_server(second)
