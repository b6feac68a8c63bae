"""The router when backends go down and come back (issue 15): /v1/models fails over, a router with
every backend down answers 503 naming each backend and its last error, and a backend back after
a long outage rejoins within one health interval, logged."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from openai import OpenAI

from postrl.rollout.native import NativeRolloutWorker
from postrl.serve.batcher import EngineBatcher
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from postrl.serve.router import LeastOutstandingRouter, build_router_app
from tests.conftest import make_tiny_model
from tests.test_serve import Server, free_port


def _backend(batcher, char_tokenizer, port=None):
    return Server(build_app(batcher, char_tokenizer, "tiny", limits=ServerLimits(default_max_tokens=2)), port=port)


def test_models_fail_over_and_all_down_is_a_503_naming_the_backends(char_tokenizer):
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer))
    live = _backend(batcher, char_tokenizer)
    dead = f"http://127.0.0.1:{free_port()}"
    router = LeastOutstandingRouter([dead, live.url], health_interval_s=60.0)
    router.state[live.url].served = 10  # the least-served pick is the dead one: the request must fail over
    front = Server(build_router_app(router))
    try:
        client = OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert not router.state[dead].healthy
        live.stop()
        out = httpx.get(front.url + "/v1/models")
        assert out.status_code == 502 and live.url in out.json()["detail"]
        assert not router.state[live.url].healthy
        for request in (
            lambda: httpx.get(front.url + "/v1/models"),
            lambda: httpx.post(front.url + "/v1/completions", json={"prompt": "1", "max_tokens": 2}),
        ):
            out = request()
            assert out.status_code == 503
            message = out.json()["detail"]
            assert message.startswith("no healthy backend to send the request to (")
            assert f"{dead}: " in message and f"{live.url}: " in message and message.count("ConnectError") == 2
    finally:
        front.stop()
        batcher.close()


@pytest.mark.slow
def test_a_backend_back_after_a_long_outage_rejoins_within_one_interval(char_tokenizer, caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = LeastOutstandingRouter([url], health_interval_s=0.2)
    front = Server(build_router_app(router))
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer))
    try:
        assert httpx.post(front.url + "/v1/completions", json={"prompt": "1", "max_tokens": 2}).status_code == 503
        time.sleep(3.0)  # 15 failed health checks: the old back-off had grown to 60 s
        assert router.state[url].failures >= 10
        with caplog.at_level(logging.WARNING, logger="postrl.serve.router"):
            backend = _backend(batcher, char_tokenizer, port=port)
            started = time.monotonic()
            while not router.state[url].healthy and time.monotonic() - started < 10:
                time.sleep(0.02)
            rejoined = time.monotonic() - started
        assert rejoined < 0.2 + 0.5, rejoined  # one interval, plus the check's own time on a busy machine
        assert f"backend {url} is healthy again and rejoins the rotation" in caplog.text
        assert httpx.post(front.url + "/v1/completions", json={"prompt": "1", "max_tokens": 2}).status_code == 200
        backend.stop()
    finally:
        front.stop()
        batcher.close()


def test_an_episodes_requests_stay_on_the_backend_that_records_it():
    """Through the router, an episode's turns (its base URL, or X-Episode-Id) all reach the backend
    that served its first one, and its recording is read back through the router; other episodes
    spread over both backends. Its backend down: the episode's next request is a 503 naming it."""
    from postrl.rollout.agentic.recorder import EpisodeRecorder
    from tests.chat_templates import family_tokenizer
    from tests.scripted_engine import ScriptedEngine

    tokenizer = family_tokenizer("qwen2.5")
    servers, batchers = [], []
    for _ in range(2):
        engine = ScriptedEngine(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
        engine.script = ["Hello there."] * 20
        batchers.append(EngineBatcher(engine))
        limits = ServerLimits(default_max_tokens=16)
        servers.append(
            Server(build_app(batchers[-1], tokenizer, "m", limits=limits, recorder=EpisodeRecorder(tokenizer)))
        )
    router = LeastOutstandingRouter([s.url for s in servers], health_interval_s=0.2)
    front = Server(build_router_app(router))
    try:
        turn = [{"role": "user", "content": "Hi"}]
        for episode in ("a", "b", "c", "d"):
            client = OpenAI(base_url=f"{front.url}/episodes/{episode}/v1", api_key="x", max_retries=0)
            first = client.chat.completions.create(model="m", messages=turn)
            history = [*turn, {"role": "assistant", "content": first.choices[0].message.content}]
            history.append({"role": "user", "content": "More"})
            second = client.chat.completions.create(model="m", messages=history)
            history.append({"role": "assistant", "content": second.choices[0].message.content})
        httpx.post(  # episode d once more, named by the header
            f"{front.url}/v1/chat/completions",
            json={"model": "m", "messages": [*history, {"role": "user", "content": "Again"}]},
            headers={"X-Episode-Id": "d"},
        )
        homes = {e: router.sticky[e] for e in "abcd"}
        assert set(homes.values()) == {s.url for s in servers}  # the episodes spread over both
        for episode in "abcd":
            view = httpx.get(f"{front.url}/v1/episodes/{episode}").json()
            turns = 3 if episode == "d" else 2
            assert (len(view["samples"]), view["prefix_breaks"], view["turns"]) == (1, 0, turns)
        home = next(s for s in servers if s.url == homes["a"])
        home.stop()
        time.sleep(0.6)
        reply = httpx.post(f"{front.url}/episodes/a/v1/chat/completions", json={"model": "m", "messages": turn})
        assert reply.status_code == 503 and "episode a" in reply.text
    finally:
        front.stop()
        for s in servers:
            s.stop()
        for b in batchers:
            b.close()
