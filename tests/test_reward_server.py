"""The Reward Service over HTTP, against a real `postrl serve-reward` process on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from postrl.config.run import RemoteRewardConfig
from postrl.reward.client import RemoteRewardService, RewardServiceError
from postrl.reward.diagnostics import process_descendants
from postrl.reward.service import ScoreRequest
from postrl.workers.net import free_port  # noqa: F401 - other tests import it from here
from tests.http_stub import LoopbackJSONServer

TOKEN = "test-token-123"
SECRET = "do-not-leak-42"


def start_server(tmp: Path, config: dict, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    path = tmp / "reward.yaml"
    path.write_text(json.dumps(config))
    return start_cli_server(["serve-reward", "--config", str(path)], env, TOKEN)


def start_cli_server(
    args: list[str], env: dict | None = None, token: str | None = None
) -> tuple[subprocess.Popen, str]:
    """``postrl ARGS --port P`` in a child process, once its /health answers (with ``token``)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "postrl.cli", *args, "--port", str(port)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"postrl {args[0]} exited: {proc.stdout.read()}")
        try:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            if httpx.get(url + "/health", headers=headers, timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"postrl {args[0]} did not come up")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_code(tmp_path_factory, processes: int = 64) -> tuple[subprocess.Popen, str]:
    tmp = tmp_path_factory.mktemp("reward_server")
    sandbox = {"wall_s": 4.0, "cpu_s": 1, "memory_mb": 512, "processes": processes}
    config = {
        "reward": {"num_workers": 2, "components": [{"name": "code", "type": "code", "sandbox": sandbox}]},
        "server": {"token_env": "POSTRL_TEST_TOKEN", "max_body_bytes": 65536, "max_batch": 64},
    }
    return start_server(tmp, config, {"POSTRL_TEST_TOKEN": TOKEN, "POSTRL_TEST_SECRET": SECRET})


@pytest.fixture(scope="module")
def code_server(tmp_path_factory):
    proc, url = serve_code(tmp_path_factory)
    yield proc, url
    stop_server(proc)


@pytest.fixture
def attack_server(tmp_path_factory):
    """The fork bomb's server: its jails may hold 8 processes of the sandbox user, which every jail
    of the machine shares (RLIMIT_NPROC counts per user), so another worker's jails, allowed 64,
    still start theirs while it runs."""
    proc, url = serve_code(tmp_path_factory, processes=8)
    yield proc, url
    stop_server(proc)


def score(url: str, samples: list[dict], token: str | None = TOKEN, timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url + "/score", json={"samples": samples}, headers=headers, timeout=timeout)


def code_sample(program: str, tests: list[str] | None = None) -> dict:
    return {
        "prompt": "write code",
        "response": f"```python\n{program}\n```",
        "columns": {"tests": tests or ["assert True"]},
    }


@pytest.mark.slow
def test_good_and_partial_programs_score_their_fraction_in_order(code_server):
    _, url = code_server
    add = "def add(a, b):\n    return a + b"
    wrong = "def add(a, b):\n    return a - b"
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"]
    answer = score(url, [code_sample(add, tests), code_sample(wrong, tests), code_sample(add, tests[:2])])
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert [r["reward"] for r in results] == [1.0, pytest.approx(1 / 3), 1.0]
    assert "test 0" in results[1]["reasons"]["code"] and results[0]["unscorable"] is False


def test_stdin_stdout_tests(code_server):
    _, url = code_server
    program = "n = int(input())\nprint(n * 2)"
    tests = {"inputs": ["3\n", "10\n"], "outputs": ["6\n", "21\n"]}
    sample = {"prompt": "", "response": program, "columns": {"tests": json.dumps(tests)}}
    [result] = score(url, [sample]).json()["results"]
    assert result["reward"] == 0.5 and "wrong output" in result["reasons"]["code"], result


@pytest.mark.slow
def test_adversarial_programs_are_contained(attack_server, tmp_path):
    proc, url = attack_server
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    outside = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)
    attacks = {
        "infinite loop": ("while True:\n    pass", "CPU time limit"),
        "sleep": ("import time\ntime.sleep(10**6)", "timed out"),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "timed out",
        ),
        "10 GB": ("x = bytearray(10 * 1024**3)", "MemoryError"),
        "1 GB of output": ("import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)", "output over"),
        "network": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')",
            "Error",
        ),
        "write outside": (f"open({str(outside)!r}, 'w').write('escaped')", "Error"),
        "secret": ("import os\nassert os.environ.get('POSTRL_TEST_SECRET') == " + repr(SECRET), "AssertionError"),
        "kill parent": (
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.killpg(0, signal.SIGKILL)\n"
            "raise SystemExit(1)",
            "",
        ),
    }
    samples = [code_sample(program, ["assert True"]) for program, _ in attacks.values()]
    answer = score(url, samples, timeout=120)
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert len(results) == len(attacks)
    for (name, (_, expected)), result in zip(attacks.items(), results):
        passed = result["reward"] == 1.0 and not result["unscorable"]
        if name != "kill parent":  # killing its own parent leaves the program's tests free to pass
            assert not passed, f"{name}: scored {result}"
            why = (result["reasons"] or {}).get("code", "") + (result["error"] or "")
            assert expected in why, f"{name}: reason {why!r} lacks {expected!r}"
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()
    assert not outside.exists()
    # the service survived, and nothing the programs started is left: only the 2 scoring workers
    assert httpx.get(url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}).json()["status"] == "ok"
    time.sleep(0.5)
    assert len(process_descendants(proc.pid)) == 2, [
        Path(f"/proc/{p}/cmdline").read_bytes() for p in process_descendants(proc.pid)
    ]
    if os.geteuid() == 0:
        nobody = [p for p in os.listdir("/proc") if p.isdigit() and os.stat(f"/proc/{p}").st_uid == 65534]
        assert not nobody, "sandbox processes were left behind"
    later = score(url, [code_sample("def f():\n    return 1", ["assert f() == 1"])]).json()["results"]
    assert later[0]["reward"] == 1.0


def test_health_reports_protections_and_metrics_are_prometheus(code_server):
    _, url = code_server
    headers = {"Authorization": f"Bearer {TOKEN}"}
    health = httpx.get(url + "/health", headers=headers).json()
    assert health["components"] == [{"name": "code", "type": "code", "weight": 1.0, "accuracy": False}]
    assert health["sandbox_protections"]["resource_limits"] is True
    text = httpx.get(url + "/metrics", headers=headers).text
    assert "# TYPE postrl_reward_request_seconds histogram" in text
    assert 'postrl_reward_request_seconds_bucket{le="+Inf"}' in text
    assert "postrl_reward_in_flight 0" in text


def test_token_body_size_and_json_checks(code_server):
    _, url = code_server
    ok = code_sample("x = 1")
    assert score(url, [ok], token=None).status_code == 401
    assert score(url, [ok], token="wrong").status_code == 401
    assert score(url, [ok]).status_code == 200
    headers = {"Authorization": f"Bearer {TOKEN}"}
    big = {"samples": [{"prompt": "p", "response": "x" * 70000, "columns": {}}]}
    assert httpx.post(url + "/score", json=big, headers=headers).status_code == 413

    def chunks():
        for _ in range(40):
            yield b"x" * 4096

    streamed = httpx.post(url + "/score", content=chunks(), headers={**headers, "content-type": "application/json"})
    assert streamed.status_code == 413
    assert httpx.post(url + "/score", content=b"\x80\x04pickle", headers=headers).status_code == 415
    bad = httpx.post(
        url + "/score", content=b'{"samples": [{"prompt": 1}]}', headers={**headers, "content-type": "application/json"}
    )
    assert bad.status_code == 422 and "samples.0" in bad.json()["detail"]
    too_many = score(url, [ok] * 65)
    assert too_many.status_code == 413 and "max_batch" in too_many.text


@pytest.mark.slow
def test_remote_client_scores_in_order_against_the_server(tmp_path):
    config = {
        "reward": {
            "num_workers": 2,
            "components": [
                {"name": "answer", "type": "exact_match"},
                {"name": "fmt", "type": "format", "weight": 0.5},
                {"name": "custom", "type": "custom", "function": "tests.reward_fns:flaky", "weight": 0.0},
            ],
        }
    }
    proc, url = start_server(tmp_path, config)
    try:
        client = RemoteRewardService(RemoteRewardConfig(url=url, batch_size=7))
        assert client.accuracy_component == "answer"
        requests = [ScoreRequest("q", f"<answer>{i % 3}</answer>", {"answer": "1", "i": i}) for i in range(20)]
        results = client.score_batch(requests)
        assert len(results) == 20
        for i, res in enumerate(results):
            if i % 5 == 0:  # tests.reward_fns:flaky raises on these
                assert res.unscorable and "custom: ValueError" in res.error
            else:
                assert res.reward == (1.0 if i % 3 == 1 else 0.0) + 0.5
                assert res.components["fmt"] == 1.0
        client.close()
    finally:
        stop_server(proc)


def scripted_server(codes: list[int]) -> LoopbackJSONServer:
    """/health answers 200; /score answers the next status in ``codes`` (503 once they run out)."""
    codes = list(codes)

    def handler(method: str, path: str, body: dict) -> tuple[int, dict]:
        if method == "GET":
            return 200, {"status": "ok", "components": []}
        code = codes.pop(0) if codes else 503
        if code != 200:
            return code, {"detail": "busy"}
        return 200, {
            "results": [{"reward": 1.0, "components": {}, "unscorable": False, "error": None} for _ in body["samples"]]
        }

    return LoopbackJSONServer(handler)


def score_calls(server: LoopbackJSONServer) -> int:
    return sum(r["path"] == "/score" for r in server.requests)


def test_client_retries_503_then_succeeds_and_gives_up_with_a_clear_error():
    sleeps: list[float] = []
    server = scripted_server([503, 503, 200])
    client = RemoteRewardService(RemoteRewardConfig(url=server.url, retries=4, backoff_s=0.2), sleep=sleeps.append)
    [result] = client.score_batch([ScoreRequest("p", "r", {})])
    assert result.reward == 1.0 and score_calls(server) == 3
    assert len(sleeps) == 2 and 0 <= sleeps[0] <= 0.2 and 0 <= sleeps[1] <= 0.4  # backoff doubles, with jitter
    server.close()

    always = scripted_server([])
    client = RemoteRewardService(RemoteRewardConfig(url=always.url, retries=2, backoff_s=0.01), sleep=lambda s: None)
    with pytest.raises(RewardServiceError, match=rf"{always.url}/score failed after 3 attempts; last error: HTTP 503"):
        client.score_batch([ScoreRequest("p", "r", {})])
    assert score_calls(always) == 3
    always.close()


def test_client_names_the_url_when_nothing_listens():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RewardServiceError, match=rf"{url}/health failed after 2 attempts; last error: ConnectError"):
        RemoteRewardService(RemoteRewardConfig(url=url, retries=1, backoff_s=0.01))
