"""The OpenAI-compatible rollout server and the router, on loopback, driven by the `openai` client."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from openai import OpenAI
from safetensors.torch import save_file

from postrl.models.weights import dedupe_tied, weight_manifest
from postrl.rollout.native import NativeRolloutWorker
from postrl.serve.batcher import EngineBatcher
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from postrl.serve.router import LeastOutstandingRouter, build_router_app
from postrl.workers.net import free_port  # noqa: F401 - other tests import it from here
from tests.conftest import hf_greedy, make_tiny_model


class Server:
    def __init__(self, app, port: int | None = None) -> None:
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def rollout_server(char_tokenizer, tmp_path):
    model = make_tiny_model("llama", char_tokenizer)
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(model, char_tokenizer, seed=0))
    limits = ServerLimits(default_max_tokens=8, weights_dir=str(tmp_path))
    server = Server(build_app(batcher, char_tokenizer, "tiny-llama", max_context=128, limits=limits))
    yield server, model
    server.stop()
    batcher.close()


def test_openai_client_completions_and_chat_with_logprobs(rollout_server, char_tokenizer):
    server, model = rollout_server
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]

    out = client.completions.create(
        model="tiny-llama", prompt=["12+34=", "1+1="], max_tokens=6, temperature=0.0, logprobs=0
    )
    assert len(out.choices) == 2 and out.usage.completion_tokens > 0
    first = out.choices[0]
    assert len(first.logprobs.token_logprobs) == len(first.logprobs.tokens) >= 1
    assert all(lp <= 0 for lp in first.logprobs.token_logprobs)
    assert (first.model_extra["token_ids"], first.finish_reason) == hf_greedy(model, char_tokenizer, "12+34=", 6)

    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=1.0,
        n=3,
        logprobs=True,
        seed=1,
    )
    assert len(chat.choices) == 3
    for choice in chat.choices:
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])


def test_concurrent_requests_are_batched_and_answered_in_order(rollout_server):
    server, _ = rollout_server
    prompts = [f"{i}+{i}=" for i in range(12)]
    results: dict[int, dict] = {}

    def ask(i: int) -> None:
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": prompts[i], "max_tokens": 4, "temperature": 0.0}, timeout=30
        )
        results[i] = r.json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    solo = {
        i: httpx.post(
            server.url + "/v1/completions", json={"prompt": prompts[i], "max_tokens": 4, "temperature": 0.0}
        ).json()
        for i in (0, 7)
    }
    for i in (0, 7):
        assert results[i]["choices"][0]["token_ids"] == solo[i]["choices"][0]["token_ids"]


def test_update_weights_endpoint_and_bad_requests(rollout_server, char_tokenizer, tmp_path):
    server, _ = rollout_server
    body = {"prompt": "5+5=", "max_tokens": 5, "temperature": 0.0, "logprobs": 0}
    before = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    state = dedupe_tied(make_tiny_model("llama", char_tokenizer, seed=5).state_dict())
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    r = httpx.post(
        server.url + "/update_weights", json={"path": str(path), "version": 3, "manifest": weight_manifest(state)}
    )
    assert r.status_code == 200 and r.json()["weight_version"] == 3
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "weight_version": 3}
    after = httpx.post(server.url + "/v1/completions", json=body).json()
    assert after["weight_version"] == 3 and after["choices"][0]["logprobs"]["token_logprobs"] != before
    bad_manifest = dict(weight_manifest(state))
    bad_manifest["model.norm.weight"] = "float32:32:00000000"
    r = httpx.post(server.url + "/update_weights", json={"path": str(path), "version": 4, "manifest": bad_manifest})
    assert r.status_code == 400 and "model.norm.weight" in r.json()["error"]["message"]
    assert (
        httpx.post(server.url + "/update_weights", json={"path": str(tmp_path / "nope"), "version": 4}).status_code
        == 400
    )
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_router_spreads_over_servers_and_broadcasts_updates(char_tokenizer, tmp_path):
    servers, batchers = [], []
    for seed in (0, 1):
        batcher = EngineBatcher(
            NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer, seed=seed)
        )
        batchers.append(batcher)
        limits = ServerLimits(default_max_tokens=4, weights_dir=str(tmp_path))
        servers.append(Server(build_app(batcher, char_tokenizer, "tiny", limits=limits)))
    router = LeastOutstandingRouter([s.url for s in servers])
    front = Server(build_router_app(router))
    try:
        client = OpenAI(base_url=front.url + "/v1", api_key="unused")
        for i in range(6):
            client.completions.create(model="tiny", prompt=f"{i}=", max_tokens=3)
        assert sorted(router.served.values()) == [3, 3]
        state = dedupe_tied(make_tiny_model("llama", char_tokenizer, seed=9).state_dict())
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        r = httpx.post(front.url + "/update_weights", json={"path": str(path), "version": 2})
        assert r.status_code == 200 and r.json()["failed"] == []
        assert all(b.worker.weight_version == 2 for b in batchers)
        assert httpx.get(front.url + "/health").json()["status"] == "ok"
    finally:
        front.stop()
        for s in servers:
            s.stop()
        for b in batchers:
            b.close()
