"""Scale-out numbers: the demo under Ray against local mode, two rollout actors against one, a
2-rank FSDP2 group against one process, and a rollout actor killed in the middle of a step.

    RAY_AUTH_MODE=disabled python benchmarks/ray_scaling.py [--json] [--steps 20]

* overhead_ratio: seconds per demo step under Ray (one rollout actor, one train actor, the
  Reward Service as an actor) over local mode, same config and seed, the first 2 steps not timed,
  runs interleaved and the best of 2 of each kept.
* scaling_2_workers: generated tokens/s of two rollout actors with one torch thread each over one
  (the demo model, 64 prompts x 8 samples x 16 tokens, 3 timed rounds after a warm-up).
* fsdp_max_loss_diff: the largest |loss| difference between a 2-rank FSDP2 group (gloo) and one
  process over 3 updates on the demo model.
* recovery_lost / recovery_duplicated: prompts without their n samples, and samples beyond n,
  after one of two rollout actors is killed 0.2 s into its generate call (64 prompts x 8 x 64 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402
from _smoke import add_smoke  # noqa: E402

from postrl.config.loading import build_config  # noqa: E402
from postrl.run.demo import DEMO_SETTINGS  # noqa: E402


def demo_seconds_per_step(scheduler: dict, steps: int, out: Path) -> float:
    from postrl.run.train_runner import train

    settings = {
        **DEMO_SETTINGS,
        "name": f"bench-{scheduler.get('type', 'local')}",
        "output_dir": str(out),
        "steps": steps,
        "scheduler": scheduler,
        "logging": {"progress_bar": False, "trackers": ["jsonl"], "console": False},
    }
    times: list[float] = []
    train(build_config(settings), on_step=lambda m: times.append(m.values["time/step_s"]))
    timed = times[2:]
    return sum(timed) / len(timed)


def demo_prompts(count: int):
    from postrl.data.dataset import build_prompts
    from postrl.models.loading import load_tokenizer
    from postrl.tasks import task_rows

    tokenizer = load_tokenizer("demo")
    rows = list(task_rows("arithmetic", "train"))[:count]
    return tokenizer, build_prompts(iter(rows), tokenizer).prompts


def pool_for(workers: int, threads: int | None):
    from postrl.rollout.factory import EngineSpec
    from postrl.scheduling.ray_scheduler import RayScheduler

    config = build_config(
        {**DEMO_SETTINGS, "scheduler": {"type": "ray", "rollout": {"workers": workers, "threads": threads}}}
    )
    return RayScheduler(config.scheduler, config.import_paths), EngineSpec.of_run(config)


def rollout_tokens_per_s(workers: int, prompts, tokenizer, rounds: int = 3) -> float:
    from postrl.models.loading import load_causal_lm
    from postrl.models.weights import dedupe_tied
    from postrl.types import SamplingParams

    scheduler, engine = pool_for(workers, threads=1)
    try:
        pool = scheduler.rollout_pool(engine, tokenizer)
        pool.update_weights(dedupe_tied(load_causal_lm("demo").state_dict()), 1, None)
        sp = SamplingParams(n=8, temperature=1.0, max_tokens=16)
        pool.generate(prompts, sp, 1)  # warm-up
        start, tokens = time.perf_counter(), 0
        for _ in range(rounds):
            tokens += sum(len(r.response_ids) for r in pool.generate(prompts, sp, 1))
        rate = tokens / (time.perf_counter() - start)
        pool.close()
        return rate
    finally:
        scheduler.close()


def recovery(prompts, tokenizer) -> tuple[int, int, int]:
    from postrl.models.loading import load_causal_lm
    from postrl.models.weights import dedupe_tied
    from postrl.types import SamplingParams

    scheduler, engine = pool_for(2, threads=1)
    try:
        pool = scheduler.rollout_pool(engine, tokenizer)
        pool.update_weights(dedupe_tied(load_causal_lm("demo").state_dict()), 1, None)
        sp = SamplingParams(n=8, temperature=1.0, max_tokens=64)
        pool.generate(prompts[:4], sp, 1)
        victim = pool.engines[1]
        killed_mid_call = []

        def kill_when_busy() -> None:  # wait until the victim holds prompts, then kill it in the middle of its call
            while victim.outstanding == 0:
                time.sleep(0.01)
            time.sleep(0.2)
            killed_mid_call.append(victim.outstanding > 0)
            victim.handle.kill()

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        out = pool.generate(prompts, sp, 1)
        killer.join()
        if killed_mid_call != [True]:
            raise RuntimeError("the rollout actor finished before it could be killed: raise max_tokens")
        counts = [sum(r.prompt_index == i for r in out) for i in range(len(prompts))]
        lost = sum(c < sp.n for c in counts)
        duplicated = sum(max(0, c - sp.n) for c in counts)
        restarts = pool.restarts
        pool.close()
        return lost, duplicated, restarts
    finally:
        scheduler.close()


def fsdp_loss_diff(updates: int = 3) -> float:
    from postrl.config.run import AlgorithmConfig, TrainConfig
    from postrl.models.loading import load_causal_lm, resolve_model_path
    from postrl.train.factory import PolicySpec
    from postrl.train.group import TrainGroup
    from postrl.train.rank import GroupSpec, TrainRank
    from postrl.train.worker import PolicyTrainer
    from postrl.types import Experience, ExperienceBatch
    from postrl.workers.clients import client
    from postrl.workers.net import free_port
    from postrl.workers.process import ProcessHandle
    from postrl.workers.roles import TrainWorker

    path = str(resolve_model_path("demo"))
    train = TrainConfig(lr=1e-4, mini_batch_size=32, micro_batch_size=8, device="cpu")
    gen = torch.Generator().manual_seed(0)
    exps = []
    for g in range(8):
        prompt = torch.randint(5, 30, (6 + g,), generator=gen).tolist()
        for k in range(4):
            r = 4 + (g * 3 + k) % 9
            exps.append(
                Experience(
                    prompt,
                    torch.randint(5, 30, (r,), generator=gen).tolist(),
                    (-torch.rand(r, generator=gen) * 2).tolist(),
                    0.0,
                    float(k % 2) - 0.5,
                    0,
                    group_id=g,
                )
            )
    batch = ExperienceBatch.from_experiences(exps, 0)
    single = PolicyTrainer(load_causal_lm(path), train, AlgorithmConfig(), seed=0)
    spec = GroupSpec(world=2, master_addr="127.0.0.1", master_port=free_port(), timeout_s=120)
    policy = PolicySpec(path, "float32", train, AlgorithmConfig(), temperature=1.0, seed=0)
    group = client(
        TrainGroup([ProcessHandle(f"train rank {r}", TrainRank, r, spec, policy) for r in range(2)]), TrainWorker
    )
    try:
        return max(
            abs(single.update(batch).get("actor/loss") - group.update(batch).get("actor/loss")) for _ in range(updates)
        )
    finally:
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    add_smoke(parser)
    args = parser.parse_args()
    rounds, prompt_count = (1, 64) if args.smoke else (2, 64)
    if args.smoke:
        args.steps = 3  # the first 2 steps are not timed
    with tempfile.TemporaryDirectory() as tmp:  # interleaved, best of 2 each: the machine's speed drifts
        runs: dict[str, list[float]] = {"local": [], "ray": []}
        for i in range(rounds):
            for kind in ("local", "ray") if i == 0 else ("ray", "local"):
                runs[kind].append(demo_seconds_per_step({"type": kind}, args.steps, Path(tmp) / f"{kind}{i}"))
        local, under_ray = min(runs["local"]), min(runs["ray"])
    tokenizer, prompts = demo_prompts(prompt_count)
    timed_rounds = 1 if args.smoke else 3
    one = rollout_tokens_per_s(1, prompts, tokenizer, timed_rounds)
    two = rollout_tokens_per_s(2, prompts, tokenizer, timed_rounds)
    lost, duplicated, restarts = recovery(prompts, tokenizer)
    diff = fsdp_loss_diff()
    result = {
        "local_s_per_step": round(local, 4),
        "ray_s_per_step": round(under_ray, 4),
        "overhead_ratio": round(under_ray / local, 3),
        "tokens_per_s_1_worker": round(one, 1),
        "tokens_per_s_2_workers": round(two, 1),
        "scaling_2_workers": round(two / one, 3),
        "fsdp_max_loss_diff": diff,
        "recovery_lost": lost,
        "recovery_duplicated": duplicated,
        "recovery_restarts": restarts,
    }
    print(f"{'measure':28s} {'value':>12s} {'target':>10s}")
    targets = {
        "overhead_ratio": "<= 1.25",
        "scaling_2_workers": ">= 1.6",
        "fsdp_max_loss_diff": "<= 1e-5",
        "recovery_lost": "0",
        "recovery_duplicated": "0",
    }
    for key, value in result.items():
        print(f"{key:28s} {value!s:>12s} {targets.get(key, ''):>10s}")
    if args.json:
        print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
