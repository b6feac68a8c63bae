"""Reward Service throughput over HTTP vs in-process, and a soak of the HTTP service.

1. Math: answers checked by math-verify, batches of 256 (32 problems x 8 samples, answers in
   mixed forms: integers, fractions, LaTeX, decimals; about half right), through
   `postrl serve-reward` on loopback with RemoteRewardService, and through the in-process
   LocalRewardService with the same number of scoring processes. Target: >= 1,000 samples/s over HTTP.
2. Code: short Python programs with 3 assert tests each, in the sandbox, same two paths.
   Target: >= 50 programs/s over HTTP.
3. Soak: 10,000 /score requests at concurrency 64 (2 samples each; in 5% of requests the first
   sample never returns and is killed on timeout, in 5% it raises). Checks every request is
   answered once, in order, with its own values; no process is left behind; the server's RSS
   at start and end.

Service and client share this machine's cores.

    python benchmarks/reward_throughput.py [--json] [--soak-requests 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import httpx
from _smoke import add_smoke

from postrl.config.run import RemoteRewardConfig, RewardConfig
from postrl.reward.client import RemoteRewardService
from postrl.reward.diagnostics import process_descendants
from postrl.reward.service import LocalRewardService, ScoreRequest

WORKERS = 2


def math_batches(n_batches: int, seed: int = 0) -> list[list[ScoreRequest]]:
    rng = random.Random(seed)
    batches = []
    for _ in range(n_batches):
        batch = []
        for _ in range(32):
            value = Fraction(rng.randint(-200, 200), rng.choice([1, 1, 2, 3, 4, 8]))
            gold = (
                str(value.numerator)
                if value.denominator == 1
                else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
            )
            forms = [
                gold,
                f"{value.numerator}/{value.denominator}" if value.denominator > 1 else f"{value.numerator}.0",
            ]
            if value.denominator in (1, 2, 4, 8):
                forms.append(str(float(value)))
            for _ in range(8):
                if rng.random() < 0.5:
                    answer = rng.choice(forms)
                else:
                    answer = str(rng.randint(-300, 300))
                text = f"Let me compute step by step. The result is \\boxed{{{answer}}}."
                batch.append(ScoreRequest("Compute it.", text, {"answer": gold}))
        batches.append(batch)
    return batches


def code_programs(n: int, seed: int = 0) -> list[ScoreRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 9)
        body = f"    return x * {k}" if rng.random() < 0.7 else f"    return x + {k}"
        program = f"```python\ndef scale(x):\n{body}\n```"
        tests = [f"assert scale({a}) == {a * k}" for a in (1, 2, 3)]
        out.append(ScoreRequest("write scale", program, {"tests": tests}))
    return out


def rate(service, batches: list[list[ScoreRequest]]) -> tuple[float, list]:
    service.score_batch(batches[0][:8])  # warm-up: worker start, imports
    start = time.perf_counter()
    results = [service.score_batch(b) for b in batches]
    elapsed = time.perf_counter() - start
    return sum(len(b) for b in batches) / elapsed, results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`postrl serve-reward` in a subprocess on loopback."""

    def __init__(self, reward: dict, tmp: Path) -> None:
        self.port = free_port()
        config = tmp / f"reward_{self.port}.yaml"
        config.write_text(json.dumps({"reward": reward}))
        self.log = tmp / f"server_{self.port}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "postrl.cli", "serve-reward", "--config", str(config), "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("serve-reward did not start")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def descendants(self) -> list[int]:
        return process_descendants(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists()]


def compare(reward: dict, batches: list[list[ScoreRequest]], tmp: Path) -> tuple[float, float, bool]:
    """(in-process rate, HTTP rate, same results) on one workload."""
    local = LocalRewardService(RewardConfig(**reward))
    try:
        local_rate, local_results = rate(local, batches)
    finally:
        local.close()
    server = Server(reward, tmp)
    try:
        client = RemoteRewardService(RemoteRewardConfig(url=server.url, batch_size=256))
        http_rate, http_results = rate(client, batches)
        client.close()
    finally:
        server.stop()
    same = [[r.reward for r in b] for b in local_results] == [[r.reward for r in b] for b in http_results]
    return local_rate, http_rate, same


async def soak(url: str, n_requests: int, concurrency: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    kinds = ["sleep"] * (n_requests // 20) + ["raise"] * (n_requests // 20)
    kinds += ["ok"] * (n_requests - len(kinds))
    rng.shuffle(kinds)
    answered = [0] * n_requests
    correct = [False] * n_requests
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        samples = [
            {"prompt": "", "response": "", "columns": {"value": i, "kind": kinds[i]}},
            {"prompt": "", "response": "", "columns": {"value": i + 0.5}},
        ]
        answer = await client.post(url + "/score", json={"samples": samples})
        answered[i] += 1
        results = answer.json()["results"]
        first, second = results
        if kinds[i] == "ok":
            ok_first = first["reward"] == i
        elif kinds[i] == "sleep":
            ok_first = first["unscorable"] and "timed out" in first["error"]
        else:
            ok_first = first["unscorable"] and "asked to raise" in first["error"]
        correct[i] = answer.status_code == 200 and len(results) == 2 and ok_first and second["reward"] == i + 0.5

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await one(client, queue.get_nowait())

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {
        "answered_once": sum(a == 1 for a in answered),
        "correct": sum(correct),
        "timeouts": kinds.count("sleep"),
        "raises": kinds.count("raise"),
        "seconds": elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--soak-requests", type=int, default=10_000)
    parser.add_argument("--soak-concurrency", type=int, default=64)
    parser.add_argument("--soak-timeout-s", type=float, default=0.25, help="per-sample timeout in the soak")
    parser.add_argument("--math-batches", type=int, default=12)
    parser.add_argument("--code-programs", type=int, default=192)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.soak_requests, args.soak_concurrency, args.math_batches, args.code_programs = 100, 8, 1, 8

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        math_reward = {"num_workers": WORKERS, "components": [{"name": "math", "type": "math"}]}
        math_local, math_http, math_same = compare(math_reward, math_batches(args.math_batches), tmp)
        code_reward = {"num_workers": WORKERS, "components": [{"name": "code", "type": "code"}]}
        programs = code_programs(args.code_programs)
        code_batches = [programs[i : i + 64] for i in range(0, len(programs), 64)]
        code_local, code_http, code_same = compare(code_reward, code_batches, tmp)

        soak_reward = {
            "num_workers": WORKERS,
            "timeout_s": args.soak_timeout_s,
            "components": [{"name": "x", "type": "custom", "function": "postrl.reward.diagnostics:misbehave"}],
        }
        server = Server(soak_reward, tmp)
        try:
            asyncio.run(soak(server.url, min(200, args.soak_requests), args.soak_concurrency, seed=1))  # warm-up
            rss_start = server.rss_mb()
            try:
                result = asyncio.run(soak(server.url, args.soak_requests, args.soak_concurrency))
            except httpx.HTTPError:
                print(
                    f"soak failed; server alive: {server.proc.poll() is None}; server log:\n"
                    + server.log.read_text()[-3000:],
                    file=sys.stderr,
                )
                raise
            rss_end = server.rss_mb()
            time.sleep(0.5)
            below = server.descendants()
            workers_now = len(below)
        finally:
            server.stop()
        time.sleep(0.5)
        leftover = len(alive(below)) + (workers_now - WORKERS if workers_now > WORKERS else 0)

    rows = [
        ("math samples/s (256/batch)", math_local, math_http, ">= 1000", math_http >= 1000),
        ("code programs/s (3 asserts)", code_local, code_http, ">= 50", code_http >= 50),
    ]
    print(f"{'workload':<30}{'in-process':>12}{'HTTP':>10}{'HTTP/in-proc':>14}  target   ok")
    for name, local, http, target, ok in rows:
        print(f"{name:<30}{local:>12.1f}{http:>10.1f}{http / local:>14.2f}  {target:<8} {'yes' if ok else 'NO'}")
    print(f"same rewards in-process and over HTTP: math {math_same}, code {code_same}")
    print(
        f"soak: {args.soak_requests} requests at concurrency {args.soak_concurrency} in {result['seconds']:.1f}s "
        f"({result['timeouts']} timing out, {result['raises']} raising): answered once {result['answered_once']}, "
        f"answered correctly {result['correct']}, leftover processes {leftover}, "
        f"server RSS {rss_start:.1f} -> {rss_end:.1f} MB"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "math_samples_per_s": round(math_http, 1),
                    "math_in_process_samples_per_s": round(math_local, 1),
                    "code_programs_per_s": round(code_http, 1),
                    "code_in_process_programs_per_s": round(code_local, 1),
                    "soak_requests": args.soak_requests,
                    "soak_answered_once": result["answered_once"],
                    "soak_answered_correctly": result["correct"],
                    "soak_leftover_procs": leftover,
                    "rss_start_mb": round(rss_start, 1),
                    "rss_end_mb": round(rss_end, 1),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
