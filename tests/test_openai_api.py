"""Issue 8 items 7-9: the rollout server behaves like the OpenAI API (streaming, top logprobs,
context limits, stop strings, refused parameters), is safe on a network, and the router routes
around failed backends."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from safetensors.torch import save_file

from postrl.models.weights import dedupe_tied
from postrl.rollout.native import NativeRolloutWorker
from postrl.serve.batcher import EngineBatcher
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from postrl.serve.router import LeastOutstandingRouter, build_router_app
from tests.conftest import make_tiny_model
from tests.test_serve import Server, free_port

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def api(char_tokenizer, weights_dir):
    model = make_tiny_model("llama", char_tokenizer)
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(model, char_tokenizer, seed=0))
    limits = ServerLimits(
        default_max_tokens=8, weights_dir=str(weights_dir), max_n=4, max_tokens=64, max_prompts=3, max_body_bytes=4096
    )
    server = Server(build_app(batcher, char_tokenizer, "tiny", max_context=128, limits=limits))
    yield server, model
    server.stop()
    batcher.close()


def client_for(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_streaming_matches_the_whole_answer(api):
    server, _ = api
    client = client_for(server)
    whole = client.completions.create(model="tiny", prompt="12+34=", max_tokens=12, temperature=0.0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="12+34=",
            max_tokens=12,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len([c for c in chunks if c.choices]) >= 2  # streamed in pieces, not one body
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0.0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_top_logprobs_on_completions_and_chat(api, char_tokenizer):
    server, model = api
    client = client_for(server)
    out = client.completions.create(model="tiny", prompt="7+8=", max_tokens=5, temperature=0.0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 5 and lp.text_offset[0] == 0
    ids = char_tokenizer("7+8=")["input_ids"]
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    best = first.topk(3)
    expected = {char_tokenizer.decode([i]): v for i, v in zip(best.indices.tolist(), best.values.tolist())}
    assert list(lp.top_logprobs[0]) == list(expected)
    assert all(abs(lp.top_logprobs[0][k] - v) < 1e-4 for k, v in expected.items())
    assert lp.tokens[0] == next(iter(expected)) and abs(lp.token_logprobs[0] - best.values[0].item()) < 1e-4

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
    )
    content = chat.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 5 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    assert content[0].token == content[0].top_logprobs[0].token
    streamed = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0.0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in tokens] == [t.token for t in content]
    assert all(len(t.top_logprobs) == 2 for t in tokens)


def test_context_limit_is_a_400_with_the_numbers(api):
    server, _ = api
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="1" * 99, max_tokens=40)
    message = err.value.body["message"]
    assert (
        "maximum context length is 128 tokens. However, you requested 140 tokens (100 in the prompt, 40 for the "
        "completion)" in message
    )
    # without max_tokens, the answer is cut at the context instead
    out = client.completions.create(model="tiny", prompt="1" * 125, temperature=1.0, seed=3, extra_body={"top_k": 1})
    assert out.usage.completion_tokens <= 3


def test_stop_strings_are_removed_unless_asked_to_keep(api):
    server, _ = api
    client = client_for(server)
    free = client.completions.create(model="tiny", prompt="3+4=", max_tokens=12, temperature=0.0).choices[0].text
    assert len(free) >= 6
    stop = free[3:5]
    cut = client.completions.create(model="tiny", prompt="3+4=", max_tokens=12, temperature=0.0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model="tiny",
        prompt="3+4=",
        max_tokens=12,
        temperature=0.0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == free[: free.index(stop) + len(stop)]
    streamed = client.completions.create(
        model="tiny", prompt="3+4=", max_tokens=12, temperature=0.0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


@pytest.mark.parametrize(
    "extra, name",
    [
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"suffix": "x"}, "suffix"),
        ({"temperatur": 0.5}, "temperatur"),
    ],
)
def test_unimplemented_parameters_are_refused_by_name(api, extra, name):
    server, _ = api
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "1+1=", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == name and f"'{name}'" in r.json()["error"]["message"]


def test_chat_refuses_tools_a_template_drops_and_accepts_text_parts(api):
    server, _ = api
    client = client_for(server)
    with pytest.raises(openai.BadRequestError, match="template drops tools=.*--tools-in-prompt system"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
        )
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=6, temperature=0.0
    )
    parts = client.chat.completions.create(
        model="tiny",
        max_tokens=6,
        temperature=0.0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="type 'image_url' is not supported"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        )


def test_wrong_model_is_404(api):
    server, _ = api
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist"):
        client_for(server).completions.create(model="gpt-4", prompt="1+1=")


def test_request_bounds_are_400s_naming_the_bound(api):
    server, _ = api
    post = lambda body: httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body})  # noqa: E731
    r = post({"prompt": "1", "n": 5})
    assert r.status_code == 400 and "n=5 is over this server's limit of 4 (--max-n)" in r.json()["error"]["message"]
    r = post({"prompt": "1", "max_tokens": 65})
    assert r.status_code == 400 and "max_tokens=65 is over this server's limit of 64" in r.json()["error"]["message"]
    r = post({"prompt": ["1", "2", "3", "4"]})
    assert r.status_code == 400 and "4 prompts in one request is over this server's limit of 3" in r.text
    r = post({"prompt": "x" * 5000})
    assert r.status_code == 413 and "over the 4096-byte limit" in r.json()["error"]["message"]


def test_update_weights_bad_file_is_400_and_engine_keeps_serving(api, weights_dir, char_tokenizer):
    server, _ = api
    before = httpx.post(
        server.url + "/v1/completions", json={"prompt": "2+2=", "max_tokens": 4, "temperature": 0}
    ).json()
    garbage = weights_dir / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file")
    r = httpx.post(server.url + "/update_weights", json={"path": str(garbage), "version": 7})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"could not load {garbage}: ")
    wrong = weights_dir / "wrong.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(wrong))
    r = httpx.post(server.url + "/update_weights", json={"path": str(wrong), "version": 7})
    assert r.status_code == 400 and "model.embed_tokens.weight" in r.json()["error"]["message"]
    after = httpx.post(
        server.url + "/v1/completions", json={"prompt": "2+2=", "max_tokens": 4, "temperature": 0}
    ).json()
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"] and after["weight_version"] == 0


def test_token_and_weights_folder_protect_the_server(char_tokenizer, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    state = dedupe_tied(make_tiny_model("llama", char_tokenizer, seed=4).state_dict())
    for folder in (allowed, outside):
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "w.safetensors"))
    (allowed / "escape.safetensors").symlink_to(outside / "w.safetensors")
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer))
    server = Server(
        build_app(batcher, char_tokenizer, "tiny", limits=ServerLimits(weights_dir=str(allowed)), token=TOKEN)
    )
    try:

        def update(path, headers):
            return httpx.post(server.url + "/update_weights", headers=headers, json={"path": str(path), "version": 1})

        good = {"authorization": f"Bearer {TOKEN}"}
        assert update(allowed / "w.safetensors", {}).status_code == 401
        assert update(allowed / "w.safetensors", {"authorization": "Bearer wrong"}).status_code == 401
        for path in (
            outside / "w.safetensors",
            allowed / "escape.safetensors",
            allowed / ".." / "outside" / "w.safetensors",
        ):
            r = update(path, good)
            assert r.status_code == 403 and "outside the weights folder" in r.json()["error"]["message"], path
        assert batcher.worker.weight_version == 0
        assert update("w.safetensors", good).status_code == 200 and batcher.worker.weight_version == 1
        assert httpx.get(server.url + "/health").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client_for(server).completions.create(model="tiny", prompt="1")
        ok = OpenAI(base_url=server.url + "/v1", api_key=TOKEN).completions.create(
            model="tiny", prompt="1", max_tokens=2
        )
        assert ok.choices[0].text is not None
    finally:
        server.stop()
        batcher.close()


@pytest.mark.slow
def test_serve_rollout_refuses_a_public_address_without_a_token():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "postrl.cli",
            "serve-rollout",
            "--model",
            "demo",
            "--host",
            "0.0.0.0",
            "--weights-dir",
            "/tmp",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--host 0.0.0.0 is not loopback" in done.stderr and "set --token-env" in done.stderr


def test_router_routes_around_dead_and_failing_backends(char_tokenizer, tmp_path):
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer))
    live = Server(build_app(batcher, char_tokenizer, "tiny", limits=ServerLimits(default_max_tokens=4)))
    failing = Server(_always_500_app())
    dead = f"http://127.0.0.1:{free_port()}"
    router = LeastOutstandingRouter([dead, failing.url, live.url], health_interval_s=5.0)
    front = Server(build_router_app(router))
    try:
        client = OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
        for i in range(6):
            out = client.completions.create(model="tiny", prompt=f"{i}+1=", max_tokens=3)
            assert out.choices[0].text is not None
        assert not router.state[dead].healthy and not router.state[failing.url].healthy
        assert router.state[live.url].served == 6
        text = "".join(
            c.choices[0].text for c in client.completions.create(model="tiny", prompt="1+1=", max_tokens=4, stream=True)
        )
        assert isinstance(text, str)
        health = httpx.get(front.url + "/health").json()
        assert health["status"] == "degraded" and health["backends"] == {
            dead: False,
            failing.url: False,
            live.url: True,
        }
        assert router.state[failing.url].failures >= 1 and "HTTP 500" in health["errors"][failing.url]
    finally:
        for s in (front, live, failing):
            s.stop()
        batcher.close()


def test_router_takes_a_recovered_backend_back(char_tokenizer):
    port = free_port()
    router = LeastOutstandingRouter([f"http://127.0.0.1:{port}"], health_interval_s=0.1)
    front = Server(build_router_app(router))
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer))
    try:
        assert httpx.post(front.url + "/v1/completions", json={"prompt": "1", "max_tokens": 2}).status_code == 503
        assert not router.state[f"http://127.0.0.1:{port}"].healthy
        backend = Server(
            build_app(batcher, char_tokenizer, "tiny", limits=ServerLimits(default_max_tokens=2)), port=port
        )
        import time

        deadline = time.monotonic() + 10
        while not router.state[backend.url].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(front.url + "/v1/completions", json={"prompt": "1", "max_tokens": 2}).status_code == 200
        backend.stop()
    finally:
        front.stop()
        batcher.close()


def test_route_and_reward_service_default_ports_differ():
    from postrl.cli import build_parser
    from postrl.config.run import RewardServerConfig

    args = build_parser().parse_args(["route", "--backend", "http://x"])
    assert args.port not in (RewardServerConfig().port, 8000)


def _always_500_app():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/v1/{path:path}")
    async def fail(path: str) -> JSONResponse:
        return JSONResponse({"detail": "boom"}, status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


class _NoStreamEngine:
    """An engine that does not stream tokens (like the vLLM backend): streams arrive whole at the end."""

    streams_tokens = False
    joins_calls = False

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompts, sampling_params, weight_version):
        return self.inner.generate(prompts, sampling_params, weight_version)


def test_engines_that_cannot_stream_still_answer_streams(char_tokenizer):
    inner = NativeRolloutWorker.from_hf(make_tiny_model("llama", char_tokenizer), char_tokenizer)
    batcher = EngineBatcher(_NoStreamEngine(inner))
    assert not batcher.streams_tokens
    server = Server(build_app(batcher, char_tokenizer, "tiny", limits=ServerLimits(default_max_tokens=6)))
    try:
        client = client_for(server)
        whole = client.completions.create(model="tiny", prompt=["1+2=", "3+4="], n=2, temperature=0.0, logprobs=1)
        chunks = list(
            client.completions.create(
                model="tiny", prompt=["1+2=", "3+4="], n=2, temperature=0.0, logprobs=1, stream=True
            )
        )
        for choice in whole.choices:
            mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
            assert "".join(c.text for c in mine) == choice.text
            assert [t for c in mine for t in c.logprobs.tokens] == choice.logprobs.tokens
            assert mine[-1].finish_reason == choice.finish_reason
    finally:
        server.stop()
        batcher.close()
